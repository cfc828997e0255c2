"""Pieces shared by the RAM- and NVMe-resident optimizer states: per-step work items and the segment update
(the part of a step that is the same for every update rule: grad staging, master weights, GPU write-back)."""
import torch

FP32 = torch.float32
LOW_PRECISION = (torch.bfloat16, torch.float16)
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MASTER = "master"


def shard(t):
    """The tensor the optimizer steps for parameter (or gradient) t: the local shard of a DTensor (FSDP2's
    fully_shard, tensor parallelism), else t itself. State is kept per shard, shaped like it."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def needs_master(p):
    """An fp32 copy kept by the optimizer is needed unless the parameter itself is a contiguous fp32 CPU tensor
    (then the kernel updates it in place and it is its own master)."""
    p = shard(p)
    return not (p.device.type == "cpu" and p.dtype == FP32 and p.is_contiguous())


def finish_all(calls):
    """Calls every one of `calls` (each waits for something: a future, a slot), then raises the first error any
    raised, so that no I/O still writes into memory about to be dropped when the error propagates."""
    error = None
    for call in calls:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the first error is raised below
            error = error or exc
    if error is not None:
        raise error


class Work:
    """One parameter that has a gradient in this step: its state `fields` (rule.fields), the rule's `update`
    and the group's `hyper` (rule.hyper). seed: the parameter's seed of bf16 stochastic rounding (its index
    in the optimizer); nonfinite: the step's int64 counter of non-finite int8 moments. The backend sets `done`
    once the parameter is fully stepped (its state stored where it lives) and, for a parameter's first step,
    puts its new state tensors in `created` (cpu mode); the optimizer then advances the count (OffloadAdam._commit)."""

    __slots__ = ("p", "t", "numel", "grad", "dst", "tmp", "src", "step", "fields", "update", "hyper", "new", "cuda",
                 "master", "low", "edited", "adopted", "seed", "nonfinite", "done", "created", "started")

    def __init__(self, p, step, fields, update, hyper, new, edited=False, seed=0, nonfinite=None):
        t = shard(p)  # p: the parameter (the state's key); t: the tensor stepped
        self.p, self.t, self.numel, self.step, self.new = p, t, t.numel(), step, new
        self.seed, self.nonfinite = seed, nonfinite
        self.done, self.created = False, None
        self.started = False  # some segment was updated (run_segment): with done False, the parameter is torn
        self.edited = edited  # changed outside the optimizer since its last step: adopt the new values first
        self.adopted = False  # some elements did differ from the master (set by adopt_edits)
        self.fields, self.update, self.hyper = fields, update, hyper
        self.cuda = t.device.type == "cuda"
        self.master = needs_master(t)
        self.low = t.dtype in LOW_PRECISION
        g = shard(p.grad).detach()
        self.grad = g.view(-1) if g.is_contiguous() else g.contiguous().view(-1)
        data = t.detach()
        if data.is_contiguous():
            self.dst, self.tmp, self.src = data.view(-1), None, data.view(-1)
        else:  # written into a contiguous temporary, copied into the parameter after its last segment
            self.tmp = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self.dst = self.tmp.view(-1)
            self.src = data.contiguous().view(-1) if new or edited else None

    def finish(self):
        if self.tmp is not None:
            self.t.detach().copy_(self.tmp)


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


def decoded_tensors(backend, fmt, params, fields_of):
    """{p: {field: new fp32 tensor}} of the fields_of(p) of each parameter, decoded from the stored state through
    backend.dump (the whole of it in RAM: save() streams instead); shaped like p, int8 scales flat."""
    out = {p: {name: fmt.empty(name, p, FP32) for name in fields_of(p)} for p in params}

    def sink(p, a, b, views):
        for name, t in out[p].items():
            fmt.part(name, t.view(-1), a, b).copy_(fmt.decode(views, name))

    backend.dump(params, sink)
    return out
