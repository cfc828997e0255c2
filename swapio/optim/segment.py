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


def run_segment(w, a, b, fields, stage_g, stage_o, threads):
    """The update of elements [a, b) of w.p. fields: CPU views of the state for those elements (a is a multiple of
    the state format's align, so int8 scales line up with the parameter's blocks). stage_g/stage_o:
    pinned uint8 buffers (>= 4*(b-a) bytes) for parameters on a GPU, else None. For a GPU parameter the
    host-to-device copy is queued (non_blocking) on the current stream; the caller synchronises."""
    n = b - a
    if w.cuda:
        grad = stage_g[:n * w.grad.element_size()].view(w.grad.dtype)
        grad.copy_(w.grad[a:b])
    else:
        grad = w.grad[a:b]
    master = fields.get(MASTER)
    if w.edited and master is not None:
        adopt_edits(w, a, b, master)
    out = None
    if master is None:
        param = w.dst[a:b]
    else:
        param = master
        if w.low:
            out = stage_o[:n * w.t.element_size()].view(w.t.dtype) if w.cuda else w.dst[a:b]
    w.update(param, grad, fields, step=w.step, param_out=out, threads=threads, seed=w.seed, index_base=a,
             nonfinite=w.nonfinite, **w.hyper)
    w.started = True
    if master is not None:
        if w.cuda:
            src = out
            if src is None:  # fp32 on the GPU: stage the master in pinned memory for an async copy
                src = stage_o[:n * 4].view(FP32)
                src.copy_(master)
            w.dst[a:b].copy_(src, non_blocking=True)
        elif not w.low:  # fp32, non-contiguous CPU parameter
            w.dst[a:b].copy_(master)
    if b == w.numel:
        w.finish()
