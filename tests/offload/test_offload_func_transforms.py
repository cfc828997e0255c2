"""torch.func's transforms over an offloaded model. vmap and jacfwd of a disk-offloaded model failed with torch's
"Cannot access storage of BatchedTensorImpl / TensorWrapper" (the transforms wrap every tensor made under them,
the ring's slices that reads land in too); they now give the resident model's results, the offloaded weights
being constants of the transform as a resident module's are. The grad transforms (jacrev, grad) cannot run through
swapio's saved-tensor hooks: a RuntimeError saying so and what to use, and the model works after it."""
import pytest
import torch

from swapio.offload import remove_offload
from helpers.offload_training import (MLP, IN, assert_same_weights, batches, build_opt, make_model, offload,
                                      one_thread, weights)

pytest.importorskip("safetensors")

STORAGES = ["disk", "cpu", "ckpt"]


@pytest.mark.parametrize("storage", STORAGES)
def test_vmap_and_jacfwd_equal_the_resident_model(tmp_path, storage):
    ref = make_model()
    model = offload(make_model(), storage, tmp_path)
    x = torch.randn(5, 1, IN)
    with one_thread():
        assert torch.equal(torch.func.vmap(model)(x), torch.func.vmap(ref)(x))
        with torch.no_grad():
            assert torch.equal(torch.func.vmap(model)(x), torch.func.vmap(ref)(x))
        assert torch.equal(torch.func.jacfwd(model)(x[0]), torch.func.jacfwd(ref)(x[0]))
        assert torch.equal(model(x[:, 0]), ref(x[:, 0]))


@pytest.mark.parametrize("transform", [torch.func.jacrev, lambda f: torch.func.grad(lambda x: f(x).sum())],
                         ids=["jacrev", "grad"])
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_grad_transforms_are_refused_saying_what_to_use(tmp_path, storage, transform):
    ref = make_model()
    model = offload(make_model(), storage, tmp_path)
    x = torch.randn(1, IN)
    transform(ref)(x)  # works on the resident model
    with pytest.raises(RuntimeError, match=r"torch\.func's grad transforms .* offloaded by swapio.*autograd\.grad"):
        transform(model)(x)
    assert torch.equal(model(x), ref(x))
    gx = torch.autograd.grad(model(x.requires_grad_()).sum(), x)[0]  # the way it names
    assert torch.equal(gx, torch.autograd.grad(ref(x).sum(), x)[0])


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_training_through_vmap_equals_the_resident_model(tmp_path, storage):
    data = batches(MLP, 2)
    ref = make_model()
    model = offload(make_model(), storage, tmp_path)
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref-swap", offload="cpu")
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload="cpu")
    with one_thread():
        for x, y in data:
            for m, o in ((ref, ref_opt), (model, opt)):
                out = torch.func.vmap(m)(x.unsqueeze(1)).squeeze(1)
                torch.nn.functional.mse_loss(out, y).backward()
                o.step()
                o.zero_grad()
    ref_opt.close()
    opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))
