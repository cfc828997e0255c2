"""The update of one slice of a parameter: the part of a step that is the same for every update rule and every
state backend (gradient staging, master weights, adopting outside edits, GPU write-back)."""
from .params import FP32, MASTER


def init_segment(w, a, b, fields):
    """First step of a parameter: zero moments (and int8 scales: a scale of 0 decodes any code to 0), master =
    the parameter's value."""
    for name, view in fields.items():
        if name == MASTER:
            view.copy_(w.src[a:b])
        else:
            view.zero_()


def adopt_edits(w, a, b, master):
    """Elements [a, b) of a parameter changed outside the optimizer: where the parameter no longer holds the master
    rounded to its dtype, the master takes the parameter's value; elsewhere it keeps its fp32 precision."""
    current = w.src[a:b].to("cpu")
    stale = current != master.to(current.dtype)
    if bool(stale.any()):
        master[stale] = current[stale].to(FP32)
        w.adopted = True


def run_segment(w, a, b, fields, grad, out, threads):
    """The update of elements [a, b) of w.p. fields: CPU views of the state for those elements (a is a multiple of
    the state format's align, so int8 scales line up with the parameter's blocks). grad: the gradient of those
    elements on the host. out: for a parameter on a GPU, the pinned buffer (of the parameter's dtype) that
    receives the updated values, which the caller copies to the device; else None."""
    master = fields.get(MASTER)
    if w.edited and master is not None:
        adopt_edits(w, a, b, master)
    if master is None:
        param = w.dst[a:b]
    else:
        param = master
        if out is None and w.low:
            out = w.dst[a:b]
    w.update(param, grad, fields, shape=w.t.shape, step=w.step, param_out=out, threads=threads, seed=w.seed,
             index_base=a, nonfinite=w.nonfinite, **w.hyper)
    w.started = True
    if master is not None and not w.cuda and not w.low:  # fp32, non-contiguous CPU parameter
        w.dst[a:b].copy_(master)
    if b == w.numel and not w.cuda:
        w.finish()
