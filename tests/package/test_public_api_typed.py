"""The public API carries type hints and docstrings (what help() shows and what type checkers read), and the
package says so to type checkers (PEP 561's py.typed). mypy itself runs in .ci/run (`mypy`, pyproject.toml)."""
import inspect
import os

import pytest

import swapio
import swapio.ops
import swapio.quant

PUBLIC = [
    swapio.AioHandle, swapio.AioHandle.__init__, swapio.AioHandle.from_config, swapio.AioHandle.pread,
    swapio.AioHandle.pwrite, swapio.AioHandle.wait, swapio.AioHandle.close, swapio.AioHandle.config,
    swapio.Future, swapio.Future.wait, swapio.Future.done, swapio.Future.exception, swapio.Future.finished,
    swapio.SwapStore, swapio.SwapStore.__init__, swapio.SwapStore.swap_out, swapio.SwapStore.remove,
    swapio.SwapStore.close, swapio.SwappedTensor, swapio.SwappedTensor.swap_in, swapio.SwappedTensor.wait,
    swapio.empty_pinned, swapio.is_pinned, swapio.info,
    swapio.ops.adam_step_, swapio.ops.adam_step_reference_, swapio.ops.lion_step_, swapio.ops.lion_step_reference_,
    swapio.ops.adafactor_step_, swapio.ops.adafactor_step_reference_,
    swapio.ops.cpu_capability, swapio.ops.cpu_capabilities,
    swapio.quant.quantize, swapio.quant.dequantize, swapio.quant.code_values, swapio.quant.num_blocks,
    swapio.quant.state_bytes_per_element,
]


def _name(obj):
    return getattr(obj, "__qualname__", repr(obj))


@pytest.mark.parametrize("obj", [o for o in PUBLIC if o.__name__ != "__init__"], ids=_name)  # (the class's)
def test_public_api_has_a_docstring(obj):
    doc = inspect.getdoc(obj)
    assert doc and len(doc) > 20, f"{_name(obj)} has no docstring for help() to show"


@pytest.mark.parametrize("obj", [o for o in PUBLIC if inspect.isfunction(o)], ids=_name)
def test_public_functions_are_annotated(obj):
    sig = inspect.signature(obj)
    missing = [p.name for p in sig.parameters.values()
               if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    assert not missing, f"{_name(obj)}: parameters without a type hint: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{_name(obj)} has no return type"


def test_the_package_is_marked_typed():
    assert os.path.isfile(os.path.join(os.path.dirname(swapio.__file__), "py.typed"))


def test_swapio_ops_does_not_show_the_argument_checks_it_shares():
    """swapio.ops is a public module: the checks and dtype tables it shares with adafactor_ops (kernels/_args.py)
    stay private to it, as they were when ops.py held them (dir(), tab completion and `swapio.ops.<name>` show the
    API, not the helpers)."""
    from swapio.kernels import _args
    helpers = {name for name, value in vars(_args).items() if not name.startswith("_") and not inspect.ismodule(value)
               and getattr(value, "__module__", _args.__name__) == _args.__name__}  # (tables have no __module__)
    assert helpers  # the check sees them
    shown = sorted(name for name in helpers if name in vars(swapio.ops))
    assert not shown, f"swapio.ops shows kernels/_args.py's {shown}"
