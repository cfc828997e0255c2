"""The native steps write in place through pointers; autograd must be told, as torch's in-place operations tell it
(each written tensor's version counter moves), so that a backward through a graph that saved the old values raises
instead of silently using the new ones. Reference: the same steps in plain torch (swapio.ops.*_reference_)."""
import pytest
import torch

ops = pytest.importorskip("swapio.ops", reason="swapio is not built (python setup.py build_ext --inplace)")
from swapio import quant  # noqa: E402

N = 300  # two int8 blocks, the second partial
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LION = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)


def moments(state, names):
    out = {}
    for name, signed in zip(names, (True, False)):
        x = torch.rand(N) * 1e-3 * (1 if not signed else -1)
        if state == "int8":
            out[name], out[name + "_scale"] = quant.quantize(x, signed)
        else:
            out[name] = x.to(torch.float32 if state == "fp32" else torch.bfloat16)
    return out


def adam(fn, state, param_out, amsgrad):
    t = dict(param=torch.randn(N), **moments(state, ("exp_avg", "exp_avg_sq")))
    kw = dict(ADAM, step=3, amsgrad=amsgrad)
    if amsgrad:
        t["max_exp_avg_sq"] = torch.rand(N) * 1e-3
    if param_out:
        t["param_out"] = torch.empty(N, dtype=torch.bfloat16)
    args = {k: v for k, v in t.items() if k not in ("param", "exp_avg", "exp_avg_sq")}
    return t, lambda: fn(t["param"], torch.randn(N), t["exp_avg"], t["exp_avg_sq"], **args, **kw)


def lion(fn, state, param_out):
    t = dict(param=torch.randn(N), **moments(state, ("exp_avg",)))
    if param_out:
        t["param_out"] = torch.empty(N, dtype=torch.bfloat16)
    args = {k: v for k, v in t.items() if k not in ("param", "exp_avg")}
    return t, lambda: fn(t["param"], torch.randn(N), t["exp_avg"], step=2, **args, **LION)


def adafactor(fn, shape, param_out):
    n = torch.Size(shape).numel()
    t = dict(param=torch.randn(n))
    if len(shape) > 1:
        t["row_var"], t["col_var"] = torch.rand(n // shape[-1]), torch.rand(n // shape[-2])
    else:
        t["variance"] = torch.rand(n)
    if param_out:
        t["param_out"] = torch.empty(n, dtype=torch.bfloat16)
    args = {k: v for k, v in t.items() if k != "param"}
    return t, lambda: fn(t["param"], torch.randn(n), shape=shape, step=2, **args)


CASES = {
    "adam-fp32": lambda f: adam(f, "fp32", False, False),
    "adam-amsgrad": lambda f: adam(f, "fp32", False, True),
    "adam-bf16-param_out": lambda f: adam(f, "bf16", True, False),
    "adam-int8": lambda f: adam(f, "int8", False, False),
    "adam-int8-param_out": lambda f: adam(f, "int8", True, False),
    "lion-fp32-param_out": lambda f: lion(f, "fp32", True),
    "lion-bf16": lambda f: lion(f, "bf16", False),
    "lion-int8": lambda f: lion(f, "int8", False),
    "adafactor-factored": lambda f: adafactor(f, (3, 20, 10), True),
    "adafactor-vector": lambda f: adafactor(f, (50,), False),
}
KERNELS = {"adam": (ops.adam_step_, ops.adam_step_reference_), "lion": (ops.lion_step_, ops.lion_step_reference_),
           "adafactor": (ops.adafactor_step_, ops.adafactor_step_reference_)}


def versions_moved(case, which):
    tensors, call = CASES[case](KERNELS[case.split("-")[0]][which])
    before = {k: v._version for k, v in tensors.items()}
    call()
    return {k: v._version > before[k] for k, v in tensors.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_tensor_written_moves_its_version_as_the_torch_reference_does(case):
    native, reference = versions_moved(case, 0), versions_moved(case, 1)
    assert native == reference
    assert native["param"]


def test_backward_through_a_graph_that_saved_the_param_raises_after_a_native_step():
    """The failure users meet: a forward's graph saved the weight, then a step wrote it. torch raises at backward
    (its own step is an in-place operation); the native step did not, and the backward used the new values."""
    for fn in (ops.adam_step_, ops.adam_step_reference_):
        p, x = torch.randn(N), torch.randn(N, requires_grad=True)
        loss = (x * p).sum()  # saves p
        fn(p, torch.randn(N), torch.zeros(N), torch.zeros(N), step=1, **ADAM)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_empty_and_inference_tensors_still_step():
    """Nothing to tell for an empty step; inference tensors count no versions (increment skips them)."""
    empty = torch.zeros(0)
    ops.adam_step_(empty, empty, empty, empty, step=1, **ADAM)
    with torch.inference_mode():
        p, m, v, g = torch.ones(8), torch.zeros(8), torch.zeros(8), torch.ones(8)
    ops.adam_step_(p, g, m, v, step=1, **ADAM)
    assert (p < 1).all()
