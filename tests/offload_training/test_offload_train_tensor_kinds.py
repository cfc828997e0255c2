"""Tensors of other kinds saved for backward inside an offloaded module's forward: a nested tensor (strided layout)
and a sparse one built from the weight's output. The saved-tensor hooks leave them where they are (only tensors in
fetched weights become tokens); the loss and, after each step of the same optimizer, the weights equal the resident
model's, bit for bit."""
import os

import pytest
import torch

from helpers.offload_training import build_opt, offload

pytest.importorskip("safetensors")


WIDTH = 16


class Kinds(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        h = self.lin(x)
        nested = torch.nested.as_nested_tensor([h[0, : WIDTH // 2], h[1, :]], layout=torch.strided)
        padded = torch.nested.to_padded_tensor(nested.sin(), 0.0)
        sparse = (h * (h > 0)).to_sparse()
        return padded.sum() + torch.sparse.sum(sparse * sparse)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_nested_and_sparse_saved_tensors_train_like_the_resident_model(tmp_path, storage):
    torch.manual_seed(0)
    ref = Kinds()
    torch.manual_seed(0)
    model = offload(Kinds(), storage, tmp_path, Kinds)
    opt = build_opt("AdamW", model.parameters(), os.path.join(tmp_path, "swap"), offload="cpu")
    ref_opt = build_opt("AdamW", ref.parameters(), os.path.join(tmp_path, "ref-swap"), offload="cpu")
    try:
        for step in range(3):
            x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(step))
            loss, ref_loss = model(x), ref(x)
            assert torch.equal(loss, ref_loss)
            loss.backward()
            ref_loss.backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            for name, p in ref.named_parameters():
                assert torch.equal(opt.param_value(dict(model.named_parameters())[name]), p), (step, name)
    finally:
        opt.close()
        ref_opt.close()
