"""torch.func's transforms over an offloaded model. vmap and jacfwd of a disk-offloaded model failed with torch's
"Cannot access storage of BatchedTensorImpl / TensorWrapper" (the transforms wrap every tensor made under them,
the ring's slices that reads land in too); they now give the resident model's results, the offloaded weights
being constants of the transform as a resident module's are. The grad transforms (jacrev, grad) cannot run through
swapio's saved-tensor hooks: a RuntimeError saying so and what to use, and the model works after it."""
import pytest
import torch

from helpers.offload_training import MLP, IN, assert_trains_as_resident, batches, make_model, offload, one_thread

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
    def vmapped_loss(m, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(torch.func.vmap(m)(x.unsqueeze(1)).squeeze(1), y)

    model = offload(make_model(), storage, tmp_path)
    assert_trains_as_resident(model, make_model(), batches(MLP, 2), tmp_path, loss=vmapped_loss)
