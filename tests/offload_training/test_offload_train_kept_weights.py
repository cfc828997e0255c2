"""A custom torch.autograd.Function that keeps the weight for its backward as an attribute (`ctx.weight = w`)
instead of ctx.save_for_backward: disk-offloaded, the weight it kept lay in the ring, which other modules' weights
reuse once the forward returns, so its backward read their bytes: gradients and trained weights silently differed
from the resident model's. Now the forward that lets such a reference escape is a RuntimeError naming the weight
and ctx.save_for_backward; save_for_backward (which swapio fetches again for the backward), torch's RNNs (which
list their weights until their next forward) and plain modules train exactly as on the resident model."""
import pytest
import torch

from helpers.offload_training import IN, OUT, assert_trains_as_resident, batches, offload

pytest.importorskip("safetensors")


class KeptAsAttribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.x, ctx.w = x, w
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.w, g.t() @ ctx.x, g.sum(0)


class Saved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


def deep(function=None, frozen=False):
    class Layer(torch.nn.Linear):
        def forward(self, x):
            return function.apply(x, self.weight, self.bias) if function else super().forward(x)

    class Deep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(IN, IN) for _ in range(6)])
            self.out = torch.nn.Linear(IN, OUT)
            self.layers.requires_grad_(not frozen)

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return self.out(x)
    return Deep


class Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(IN, IN, batch_first=True)
        self.out = torch.nn.Linear(IN, OUT)

    def forward(self, x):
        return self.out(self.rnn(x.unsqueeze(1).repeat(1, 3, 1))[0][:, -1])


class ReturnsItsWeight(torch.nn.Module):
    """A module whose forward returns its own weight (a learned position embedding): swapio copies that output,
    which its caller holds while the forward returns."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(1, IN)
        self.out = torch.nn.Linear(IN, OUT)
        self.pos.forward = lambda: self.pos.weight[0]

    def forward(self, x):
        return self.out(torch.tanh(x + self.pos()))


def build(cls):
    torch.manual_seed(0)
    return cls()


def train_both(tmp_path, cls, storage, steps=3):
    """Trains the resident model and an offloaded copy (a ring of two records) side by side."""
    model = offload(build(cls), storage, tmp_path, cls, buffer_bytes=8192)
    assert_trains_as_resident(model, build(cls), batches(None, steps), tmp_path)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("storage", ["disk", "ckpt"])
def test_a_weight_kept_as_a_ctx_attribute_is_refused(tmp_path, storage, frozen):
    cls = deep(KeptAsAttribute, frozen)
    model = offload(build(cls), storage, tmp_path, cls, buffer_bytes=8192)
    x = torch.randn(3, IN, requires_grad=frozen)
    with pytest.raises(RuntimeError, match=r"layers\.0\.weight is offloaded by swapio, and something still "
                                           r"references.*ctx\.save_for_backward"):
        model(x)
    with torch.no_grad():  # the model works on, and a forward that keeps nothing is fine
        assert torch.equal(model(x), build(cls)(x))


@pytest.mark.parametrize("cls", [deep(Saved), deep(), Recurrent, ReturnsItsWeight],
                         ids=["save_for_backward", "linear", "lstm", "returns_its_weight"])
@pytest.mark.parametrize("storage", ["disk", "ckpt"])
def test_weights_not_kept_train_as_resident(tmp_path, storage, cls):
    train_both(tmp_path, cls, storage)


class KeptAsView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.x, ctx.wt = x, w.t()
        return x @ ctx.wt + b

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.wt.t(), g.t() @ ctx.x, g.sum(0)


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_a_view_of_the_weight_kept_as_a_ctx_attribute_is_refused(tmp_path, frozen):
    # (what docs/offload.md says: a view kept is seen, of a trained weight too)
    cls = deep(KeptAsView, frozen)
    model = offload(build(cls), "disk", tmp_path, cls, buffer_bytes=8192)
    with pytest.raises(RuntimeError, match=r"layers\.0\.weight is offloaded by swapio, and something still "):
        model(torch.randn(3, IN, requires_grad=frozen))
