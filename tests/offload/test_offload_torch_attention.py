"""torch's own attention modules offloaded. nn.MultiheadAttention passes its out_proj's weight to
F.multi_head_attention_forward instead of calling out_proj, so it (and nn.TransformerEncoder / Decoder built on it)
failed on the meta placeholder ("multi_head_attention_forward() used ...out_proj.weight") unless the user named it
in preload_module_classes. It is preloaded without being named now: outputs, and training with a swapio optimizer,
equal the resident model's bit for bit."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload
from swapio.optim import OffloadAdamW


class SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)[0]


MODELS = {
    "MultiheadAttention": SelfAttention,
    "TransformerEncoder": lambda: torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False),
    "TransformerDecoderLayer": lambda: torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
}
X = torch.randn(3, 5, 8)


def make(kind):
    torch.manual_seed(0)
    return MODELS[kind]()


def run(kind, model):
    return model(X, X) if kind == "TransformerDecoderLayer" else model(X)


def offload(how, model, tmp_path):
    return disk_offload(model, tmp_path / "od") if how == "disk" else cpu_offload(model)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_inference_equals_resident(tmp_path, how, kind):
    reference = make(kind).eval()
    model = offload(how, make(kind).eval(), tmp_path)
    with torch.no_grad():
        assert torch.equal(run(kind, model), run(kind, reference))
    assert torch.equal(run(kind, model), run(kind, reference))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_training_equals_resident(tmp_path, how, kind):
    reference, model = make(kind), offload(how, make(kind), tmp_path)
    for m in (reference, model):
        with OffloadAdamW(m.parameters(), lr=1e-2) as opt:
            m.losses = []
            for _ in range(2):
                loss = run(kind, m).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                m.losses.append(loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(model.losses, reference.losses))
    remove_offload(model)
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, r), name
