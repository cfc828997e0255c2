"""torch's parametrizations on a model offloaded after they were registered (wav2vec2's positional convolution
is weight-normed so): the parametrization module owns the original tensors and is a unit of its own, so its forward
fetches them and the weight it computes is real. Outputs in eval and train mode and trained weights equal the
resident model's. The older hook-based torch.nn.utils.weight_norm / spectral_norm compute the weight in a forward
pre-hook, before swapio brings the tensors in: a RuntimeError naming the tensor."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (HID, IN, OUT, assert_same_weights, batches, build_opt, loss_of, offload,
                                      one_thread, weights)

pytest.importorskip("safetensors")

NORMS = {"weight_norm": torch.nn.utils.parametrizations.weight_norm,
         "spectral_norm": torch.nn.utils.parametrizations.spectral_norm,
         "orthogonal": torch.nn.utils.parametrizations.orthogonal,
         "old_weight_norm": torch.nn.utils.weight_norm,
         "old_spectral_norm": torch.nn.utils.spectral_norm}


def normed(kind):
    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(IN, HID)
            self.b = NORMS[kind](torch.nn.Linear(HID, HID))
            self.c = torch.nn.Linear(HID, OUT)

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
    return Normed


def build(cls):
    torch.manual_seed(0)
    return cls()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_parametrized_model_offloaded_trains_as_resident(tmp_path, storage, kind):
    cls, data = normed(kind), batches(None, 3)
    ref = build(cls)
    model = offload(build(cls), storage, tmp_path, cls)
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref-swap", offload="cpu")
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload="cpu")
    with one_thread():
        for b in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                m.eval()
                with torch.no_grad():
                    m.evaluated = m(b[0])
                m.train()
                m.loss = loss_of(m, b)
                m.loss.backward()
                o.step()
                o.zero_grad()
            assert torch.equal(model.evaluated, ref.evaluated) and torch.equal(model.loss, ref.loss)
    ref_opt.close()
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))
    for (name, t), (_, r) in zip(model.named_buffers(), ref.named_buffers()):  # spectral_norm's power iteration
        assert torch.equal(t, r), name


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind,tensor", [("old_weight_norm", "weight_v"), ("old_spectral_norm", "weight_orig")])
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_hook_based_norms_are_refused_naming_the_tensor(tmp_path, storage, kind, tensor):
    model = offload(build(normed(kind)), storage, tmp_path, normed(kind))
    with pytest.raises(RuntimeError, match=rf"b\.{tensor}, which is offloaded by swapio.*forward pre-hooks run before"):
        model(torch.randn(2, IN))
