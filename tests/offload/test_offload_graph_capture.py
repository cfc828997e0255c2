"""torch.jit.trace, torch.jit.script and torch.export of an offloaded model. They failed with torch's own errors that
said nothing of the cause: an INTERNAL ASSERT of the JIT's alias analysis (trace), "'_Restore' object has no
attribute '__name__'" (script), and for export "0.weight ... was replaced between forwards" (export's fake
tensors taken for the user's replacement) or "'OffloadedForward' object has no attribute '__code__'". Now each
is a RuntimeError naming the capture, swapio and what to do, the model works on after it, and after
remove_offload the capture works as on any resident model."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload


class OwnWeight(torch.nn.Module):
    """A root module that owns a weight itself (the root is then an offloaded unit, its forward swapio's wrapper)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(torch.nn.functional.linear(x, self.w))


MODELS = {"sequential": lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)),
          "own-weight": OwnWeight}
X = torch.randn(2, 4)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")

CAPTURES = {
    "jit.trace": (lambda m: torch.jit.trace(m, X), r"torch\.jit\.trace of a model offloaded by swapio"),
    "jit.trace_module": (lambda m: torch.jit.trace_module(m, {"forward": X}, check_trace=False),
                         r"torch\.jit\.trace of a model offloaded by swapio"),
    "jit.script": (torch.jit.script, r"torch\.jit\.script of a model offloaded by swapio"),
    "export": (lambda m: torch.export.export(m, (X,)), r"torch\.export of a model offloaded by swapio"),
}


def make(kind):
    torch.manual_seed(0)
    return MODELS[kind]().eval()


def offload(how, model, tmp_path):
    return disk_offload(model, tmp_path / "od") if how == "disk" else cpu_offload(model)


@pytest.mark.parametrize("capture", list(CAPTURES))
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("how", ["cpu", "disk"])
def test_capture_is_refused_naming_it_and_the_model_works_on(tmp_path, how, kind, capture):
    reference = make(kind)
    model = offload(how, make(kind), tmp_path)
    do, message = CAPTURES[capture]
    with pytest.raises(RuntimeError, match=message + r".*torch\.compile.*remove_offload\(model\) first"):
        do(model)
    assert all(p.is_meta for p in model.parameters())
    assert torch.equal(model(X), reference(X))
    remove_offload(model)
    assert "__prepare_scriptable__" not in model.__dict__
    captured = do(model)  # resident again: torch captures it
    run = captured.module() if capture == "export" else captured
    assert torch.equal(run(X), reference(X))


@pytest.mark.parametrize("capture", ["jit.trace", "jit.script"])
def test_capturing_an_offloaded_submodule_is_refused(tmp_path, capture):
    model = cpu_offload(make("sequential"))
    with pytest.raises(RuntimeError, match=r"torch\.jit\.\w+ of a model offloaded by swapio"):
        torch.jit.trace(model[2], torch.randn(2, 8)) if capture == "jit.trace" else torch.jit.script(model[2])


def test_strict_export_names_swapio(tmp_path):
    """export(strict=True) traces with dynamo, which stops at swapio's eager boundaries with their reason."""
    model = cpu_offload(make("sequential"))
    with pytest.raises(Exception, match=r"offloaded by swapio runs eagerly"):
        torch.export.export(model, (X,), strict=True)
    assert torch.equal(model(X), make("sequential")(X))


def test_a_replaced_submodule_scripts_and_converts_after_remove_offload(tmp_path):
    """An offloaded submodule replaced in the model and kept elsewhere is resident again after remove_offload: the
    refusals (scripting, conversions) go with the offload."""
    model = cpu_offload(make("sequential"))
    old = model[2]
    model[2] = torch.nn.Linear(8, 3)
    remove_offload(model)
    assert torch.equal(torch.jit.script(old)(torch.ones(1, 8)), old(torch.ones(1, 8)))
    assert old.double().weight.dtype == torch.float64
