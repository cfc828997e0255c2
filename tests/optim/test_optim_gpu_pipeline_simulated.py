"""The GPU step pipeline of the offloaded optimizers, run on the CPU against a simulated CUDA layer.

Parameters flagged as "on the GPU" are CPU tensors; streams run their queued copies only when the host waits for
an event recorded after them (or another stream waits for it), as a GPU may run them late. So a pipeline that
reads a gradient before its copy finished, reuses a staging buffer before the copy out of it ran, or lets the
next forward read parameters before their copies, computes wrong numbers here; one that waits for a whole
device, or for each copy before the next kernel, shows it in the trace. Numbers are checked against
torch.optim.AdamW on resident parameters.
"""
import contextlib
import ctypes
import gc
import warnings

import pytest
import torch

import swapio
from helpers.autograd import OnBackward
from helpers.fake_cuda import Event, Stream
from swapio.core import cuda_copy, pinned
from swapio.optim import grad_copies, params as params_mod, work as work_mod


@pytest.fixture
def fake_gpu(monkeypatch):
    """Tensors in `gpu` count as on a GPU; returns (gpu set, compute stream, side streams, trace)."""
    trace, wrote_freed, changed_sources = [], [], []
    compute = Stream("compute", trace)
    sides = {"to_device": Stream("h2d", trace), "to_host": Stream("d2h", trace)}
    gpu = set()

    def on_gpu(t):
        t = params_mod.shard(t)
        return any(t.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() for g in gpu)

    def copy_async(dst, src, stream, wait_for=None, hold=True):
        if wait_for is not None:
            stream.wait_event(wait_for)
        what = "to device" if on_gpu(dst) else "to host"
        if on_gpu(dst):
            torch.autograd.graph.increment_version(dst)  # as the real copy_ does when it is queued

        # a GPU reads a pinned host source when the copy runs: it must not change before
        queued = src.detach().clone() if pinned.is_pinned(src) else None

        def run(dst=dst.detach(), src=src.detach()):
            if queued is not None and not torch.equal(_bytes(src), _bytes(queued)):
                changed_sources.append(stream.name)
            with torch.no_grad():
                dst.data.copy_(src)
        if not hold and pinned.is_pinned(dst) and dst.is_contiguous():
            # the caller keeps the pinned destination alive until the copy ran (hold=False): held here only by
            # its address, a copy that runs once it was freed is recorded (and not made)
            ptr, shape, dtype, nbytes = dst.data_ptr(), dst.shape, dst.dtype, dst.numel() * dst.element_size()

            def run(src=src.detach()):
                if pinned._block_of(ptr) is None:
                    wrote_freed.append(stream.name)
                    return
                target = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
                target.view(dtype).view(shape).copy_(src)
        trace.append(("queued", stream.name, what))
        stream.enqueue(run, what)
        event = Event()
        event.record(stream)
        return event

    def synchronize(*args):
        raise AssertionError("the step waited for the whole device")
    Event.trace = trace
    for module in (params_mod, work_mod, grad_copies, swapio.optim.nvme_state, swapio.optim.cpu_state,
                   swapio.optim.gpu_in_backward):
        monkeypatch.setattr(module, "on_gpu", on_gpu, raising=False)
    monkeypatch.setattr(cuda_copy, "copy_async", copy_async)
    monkeypatch.setattr(cuda_copy, "copy_stream", lambda device, direction="to_device": sides[direction])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    yield gpu, compute, sides, trace
    for stream in (compute, *sides.values()):
        stream.run_until(len(stream.ops))  # what the GPU had left
    cuda_copy.release_finished()
    assert not wrote_freed, f"copies on {wrote_freed} wrote into pinned memory already freed"
    assert not changed_sources, f"copies on {changed_sources} read host memory changed after they were queued"


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.Tanh(), torch.nn.Linear(384, 40)).to(dtype)


def _on_fake_gpu_with_reference(gpu, dtype):
    """_model(dtype) on the fake GPU, fp32 copies of its parameters and torch's AdamW over them (lr 1e-2)."""
    model = _model(dtype)
    gpu.update(p.detach() for p in model.parameters())
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    return model, master, torch.optim.AdamW(master, lr=1e-2)


def _assert_matches(model, master):
    """The fake GPU's parameters equal torch's AdamW over the fp32 copies (to float32 rounding)."""
    for p, m in zip(model.parameters(), master):
        torch.testing.assert_close(p, m, rtol=0, atol=1e-6)


def _loss(model, i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 64, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().square().mean()


def _steps_match_torch(model, compute, opt, ref, ref_opt, batches):
    """Steps opt (on the simulated GPU) and torch's ref_opt (over ref, copies of model's parameters) on each batch
    index of `batches`; the parameters stay within float32 rounding of torch's."""
    for i in batches:
        _loss(model, i).backward()
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        compute.run_until(len(compute.ops))
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p, r, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("habit", ["plain", "torch_clip", "accumulate", "opt_clip"])
def test_gpu_parameters_step_like_torch_through_the_asynchronous_pipeline(fake_gpu, dtype, habit):
    gpu, compute, side, trace = fake_gpu
    model = _model(dtype)
    gpu.update(p.detach() for p in model.parameters())
    # 8192-element staging segments: the weights take three and two, through two buffers in rotation
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", buffer_bytes=4 << 16,
                                    buffer_count=4)
    assert opt._backend.staging.capacity == 8192
    # the reference: torch's AdamW on fp32 copies, fed the same gradients (as found by step())
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2)
    micro = 2 if habit == "accumulate" else 1
    for step in range(4):
        for k in range(micro):
            _loss(model, 10 * step + k).backward()
        if habit == "torch_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif habit == "opt_clip":
            opt.clip_grad_norm_(0.05)
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        del trace[:]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "changed outside the optimizer": the copies are the optimizer's
            opt.step()
        queued_d2h = sum(1 for e in trace if e[:2] == ("queued", "d2h") and e[2] == "to host")
        if habit in ("plain", "accumulate"):
            assert queued_d2h == 0  # the gradients came over in backward
        else:
            assert queued_d2h == 3 + 1 + 2 + 1  # clipped after backward: copied again, segment by segment
        waited_h2d = [e for e in trace if e[0] == "host waits" and e[2] == "to device"]
        assert all(e[3] >= 1 for e in waited_h2d)  # for a staging buffer two segments back only: the copy
        # out of the last segment still runs when the next kernel starts
        assert compute.ops[-1][1] == "wait"  # the next forward waits for the copies on the GPU, not the host
        before = [p.detach().clone() for p in model.parameters()]
        compute.run_until(len(compute.ops))  # the next forward's turn on the GPU
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # copies ran only now
        ref_opt.step()
        for p, m in zip(model.parameters(), master):
            torch.testing.assert_close(opt.state[p]["master"], m.detach(), rtol=0, atol=1e-6)
            if dtype == torch.float32:
                torch.testing.assert_close(p, m, rtol=0, atol=1e-6)
            else:  # rounded to nearest from masters equal to ~1e-7: equal but for a rare tie
                assert (p != m.to(dtype)).float().mean() < 0.002
        opt.zero_grad()
    parts = opt.memory_report()["pinned_parts"]  # every pinned buffer counted
    assert parts["gpu_grads"]["bytes"] >= sum(p.numel() * p.element_size() for p in model.parameters())
    if dtype == torch.float32:  # masters pinned, copied to the GPU straight from there
        assert parts["gpu_masters"]["bytes"] == sum(p.numel() * 4 for p in model.parameters())
    opt.close()


def test_in_backward_updates_gpu_parameters_during_backward_like_torch(fake_gpu):
    gpu, compute, side, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True,
                                    buffer_bytes=4 << 16, buffer_count=4)
    master = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2)
    updated_in_backward = []
    real_step = opt._step_in_backward
    opt._gpu_in_backward._step_params = lambda params, copies: (updated_in_backward.append(len(params)),
                                                                 real_step(params, copies))
    for step in range(3):
        _loss(model, step).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.clone()
        opt.step()
        assert sum(updated_in_backward) == 4 * (step + 1)  # every parameter, by the worker, not by step()
        assert all(int(opt.state[p]["step"]) == step + 1 for p in model.parameters())
        assert compute.ops[-1][1] == "wait"  # the next forward waits for the copies (on the GPU)
        compute.run_until(len(compute.ops))
        ref_opt.step()
        _assert_matches(model, master)
        if step == 2:  # a second step() before zero_grad() steps again with the same gradients, as torch does
            opt.step()
            ref_opt.step()
            compute.run_until(len(compute.ops))
            assert all(int(opt.state[p]["step"]) == 4 for p in model.parameters())
            _assert_matches(model, master)
        opt.zero_grad()
        ref_opt.zero_grad()
    _loss(model, 9).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # too late: backward already used the gradients
    with pytest.raises(RuntimeError, match="in_backward=False"):
        opt.step()
    opt.close()


def _fail():
    """In backward: one that fails partway (the layers after this point got their gradients)."""
    raise RuntimeError("simulated failure in backward")


def test_in_backward_a_failed_backward_ends_its_gpu_updates_before_its_error_reaches_the_caller(fake_gpu):
    # A backward that raised had handed the last layer's gradients to the worker; its error reached the caller
    # while the worker still had to run them, so an lr set right after the catch (before zero_grad()) reached
    # those updates. As torch's optimizer-in-backward hooks (and offloaded weights) have it, they end before the
    # error does, with the options of then: equal to torch's AdamW stepping the last layer with lr 0.01.
    import threading
    gpu, compute, sides, trace = fake_gpu
    model, master, ref_opt = _on_fake_gpu_with_reference(gpu, torch.float32)
    first, _, last = model
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    release = threading.Event()
    real_step = opt._gpu_in_backward._step_params
    opt._gpu_in_backward._step_params = lambda params, copies: (release.wait(), real_step(params, copies))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    loss = last(torch.tanh(OnBackward.apply(first(x), _fail))).square().mean()
    threading.Timer(0.3, release.set).start()  # the worker runs late
    with pytest.raises(RuntimeError, match="simulated failure"):
        loss.backward()
    opt.param_groups[0]["lr"] = 0.1  # right after the catch
    opt.zero_grad()
    # the reference: the same backward without the failure, the first layer's gradients dropped
    ref_loss = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, master[0], master[1])),
                                          master[2], master[3]).square().mean()
    ref_loss.backward()
    master[0].grad = master[1].grad = None
    ref_opt.step()
    ref_opt.zero_grad()
    ref_opt.param_groups[0]["lr"] = 0.1
    _loss(model, 1).backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.clone()
    opt.step()
    ref_opt.step()
    compute.run_until(len(compute.ops))
    _assert_matches(model, master)
    opt.close()


def test_a_late_gpu_reads_each_step_values_not_the_next_ones(fake_gpu):
    # The GPU may run the copies of step k only after the host has started step k+1: the kernel must not write a
    # pinned master that a copy still reads (the forward queued after step k would see step k+1 values). Two
    # step()s on one backward's gradients (torch steps twice) have no gradient copy in between to order them.
    gpu, compute, sides, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu")
    seen, expected = [], []
    _loss(model, 0).backward()
    for step in range(2):
        opt.step()
        expected.append([opt.state[p]["master"].clone() for p in model.parameters()])
        # the next forward, queued on the compute stream: it reads the parameters when the GPU gets there
        compute.enqueue(lambda: seen.append([p.detach().clone() for p in model.parameters()]), "forward")
    compute.run_until(len(compute.ops))
    for got, want in zip(seen, expected):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvme_segments_sharing_a_chunk_do_not_overwrite_staging_a_copy_still_reads(fake_gpu, tmp_path, dtype):
    # A chunk of the swap file holds segments of several parameters (a weight's tail, a bias, the next weight's
    # head); each segment's new values go to the GPU from the slot's staging while the next segment computes.
    gpu, compute, sides, trace = fake_gpu
    model, master, ref_opt = _on_fake_gpu_with_reference(gpu, dtype)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="nvme", swap_dir=tmp_path)
    for step in range(2):
        _loss(model, step).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        assert any(len(c.segments) > 1 for c in opt._backend.chunks)
        compute.run_until(len(compute.ops))  # the next forward's turn on the GPU
        ref_opt.step()
        for p, m in zip(model.parameters(), master):
            # the master agrees with torch's to ~1e-7 (which may move a bf16 rounding tie, machine by machine);
            # the parameter is exactly its master rounded, so no copy was overwritten on its way
            torch.testing.assert_close(opt.state_dict()["state"][_index(opt, p)]["master"] if dtype != torch.float32
                                       else p.detach(), m.detach(), rtol=0, atol=1e-6)
            if dtype != torch.float32:
                assert torch.equal(p.detach(), opt.state_dict()["state"][_index(opt, p)]["master"].to(dtype))
        opt.zero_grad()
    opt.close()


def _index(opt, p):
    return next(i for i, q in enumerate(q for g in opt.param_groups for q in g["params"]) if q is p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_work_queued_between_backward_and_step_reads_the_values_before_the_step(fake_gpu, dtype):
    # Whatever the program queued on the compute stream before step() (a weight norm for logging, an EMA update)
    # reads the values before the step, as with torch: the copies of the new values wait for it, not only for
    # the kernels that produced the gradients.
    gpu, compute, sides, trace = fake_gpu
    model = _model(dtype)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", buffer_bytes=4 << 16,
                                    buffer_count=4)
    _loss(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    compute.enqueue(lambda: seen.append([p.detach().clone() for p in model.parameters()]), "user reads")
    opt.step()
    sides["to_device"].run_until(len(sides["to_device"].ops))  # the GPU may run the copies first...
    compute.run_until(len(compute.ops))  # ...if nothing orders them after the read
    for got, want in zip(seen[0], before):
        assert torch.equal(got, want)
    opt.close()


def test_a_dropped_in_backward_optimizer_stops_updating_the_model(fake_gpu):
    # Its hooks stay on the model; dropping the last reference (a notebook cell building a new optimizer) must free
    # it at once, not at the next full garbage collection, else every backward until then steps the model with it.
    import gc
    import weakref
    gpu, compute, sides, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    _loss(model, 0).backward()
    opt.step()
    opt.zero_grad()
    compute.run_until(len(compute.ops))
    gc.disable()
    try:
        dropped = weakref.ref(opt)
        del opt
        assert dropped() is None
        before = [p.detach().clone() for p in model.parameters()]
        _loss(model, 1).backward()
        compute.run_until(len(compute.ops))
        sides["to_device"].run_until(len(sides["to_device"].ops))
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p, b)
    finally:
        gc.enable()


def test_in_backward_refuses_a_second_backward_before_step(fake_gpu):
    # torch would step once with the sum of the two gradients; each backward updating the parameters would step
    # twice (and the second gradient's copy would overwrite the first while the worker may still read it). As for
    # offloaded weights: a RuntimeError naming in_backward=False, before the second gradient's copy.
    gpu, compute, sides, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    _loss(model, 0).backward()
    queued = sum(1 for e in trace if e[:2] == ("queued", "d2h"))
    with pytest.raises(RuntimeError, match="in_backward=False"):
        _loss(model, 1).backward()
    assert sum(1 for e in trace if e[:2] == ("queued", "d2h")) == queued
    opt.zero_grad()  # (waits for the worker)
    assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters())
    for step in range(2):  # one backward per step() is fine again, with or without zero_grad() between
        _loss(model, 2 + step).backward()
        opt.step()
        assert all(int(opt.state[p]["step"]) == 2 + step for p in model.parameters())
    opt.close()


def test_in_backward_refuses_an_lr_changed_between_backward_and_step(fake_gpu):
    # torch's step() uses the lr of step() time; the worker stepped the GPU parameters during backward with the lr
    # of then. A scheduler stepped (or an lr set) between backward and step() used to be silently ignored for
    # those, and used for whatever step() stepped itself. Now step() raises; with the lr set back it steps, equal
    # to torch.optim.AdamW with the lr never changed.
    gpu, compute, sides, trace = fake_gpu
    model, master, ref_opt = _on_fake_gpu_with_reference(gpu, torch.float32)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    _loss(model, 0).backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.clone()
    opt.state_dict()  # waits for the worker: its updates have run
    opt.param_groups[0]["lr"] = 0.1
    with pytest.raises(RuntimeError, match=r"(?s)lr 0\.01 -> 0\.1.*in_backward=False"):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()
    ref_opt.step()
    compute.run_until(len(compute.ops))
    _assert_matches(model, master)
    opt.close()


@pytest.mark.slow
@pytest.mark.parametrize("read", ["state_dict", "save", "memory_report"])
def test_reading_the_state_right_after_backward_waits_for_the_in_backward_worker(fake_gpu, tmp_path, read):
    # backward() returns while the worker may still update the last parameters: what state_dict(), save() and
    # memory_report() see is the state after those updates, never half of it.
    import threading
    gpu, compute, sides, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    release = threading.Event()
    real_step = opt._gpu_in_backward._step_params
    opt._gpu_in_backward._step_params = lambda params, copies: (release.wait(), real_step(params, copies))
    _loss(model, 0).backward()

    def state_steps():
        if read == "state_dict":
            return [int(st["step"]) for st in opt.state_dict()["state"].values()]
        if read == "memory_report":
            return [opt.memory_report()["params"]]
        opt.save(tmp_path / "ckpt")
        # (over copies: the model's parameters are claimed by opt, whose hooks update them during backward)
        other = swapio.optim.OffloadAdamW([p.detach().clone().requires_grad_() for p in model.parameters()],
                                          lr=1e-2, offload="cpu")
        other.load(tmp_path / "ckpt")
        return [int(st["step"]) for st in other.state_dict()["state"].values()]
    seen = []
    reader = threading.Thread(target=lambda: seen.append(state_steps()))
    reader.start()
    reader.join(0.5)  # it waits for the worker (else it has read the state before the updates)
    release.set()
    reader.join()
    n = sum(p.numel() for p in model.parameters())
    assert seen[0] == ([n] if read == "memory_report" else [1, 1, 1, 1])
    opt.step()
    opt.close()


def test_an_error_in_the_in_backward_worker_leaves_the_parameters_it_stepped_stepped(fake_gpu, monkeypatch):
    # The worker fails in the middle of a batch (pinned memory refused for a new state, say): the parameters of
    # that batch it had stepped before the error are stepped; a step() after the error must not step them again.
    import threading
    gpu, compute, sides, trace = fake_gpu
    model, master, ref_opt = _on_fake_gpu_with_reference(gpu, torch.float32)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    release = threading.Event()
    real_step = opt._gpu_in_backward._step_params
    opt._gpu_in_backward._step_params = lambda params, copies: (release.wait(), real_step(params, copies))
    failing = []
    real_empty = swapio.optim.cpu_state.CpuState._empty

    def empty(self, name, p):
        if p is failing[0]:
            raise MemoryError("pinned memory refused")
        return real_empty(self, name, p)
    monkeypatch.setattr(swapio.optim.cpu_state.CpuState, "_empty", empty)
    _loss(model, 0).backward()  # the worker holds its first batch; the other three wait as the second
    failing.append(max(model.parameters(), key=opt._grad_copies.arrival))
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.clone()
    release.set()
    with pytest.raises(MemoryError):
        opt.step()
    monkeypatch.setattr(swapio.optim.cpu_state.CpuState, "_empty", real_empty)
    opt.step()  # steps what the worker did not
    ref_opt.step()
    compute.run_until(len(compute.ops))
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [1, 1, 1, 1]
    _assert_matches(model, master)
    opt.close()


def _gated_gpu_worker(monkeypatch):
    """An event that holds the in_backward worker before each batch until it is set (before it resolves the
    optimizer's step)."""
    import threading
    release = threading.Event()
    real = grad_copies.GradCopies.copied_as
    monkeypatch.setattr(grad_copies.GradCopies, "copied_as", lambda self, p: (release.wait(), real(self, p))[1])
    return release


def test_a_gpu_in_backward_optimizer_dropped_right_after_backward_lands_its_updates_once(fake_gpu, monkeypatch):
    # The update is part of backward, as with torch's optimizer-in-backward hooks: the worker's queued work keeps
    # the optimizer alive until it ran, then frees it (no cycle); the compute stream then waits for the copies of
    # the new values, as step() would have made it.
    import gc
    import weakref
    gpu, compute, sides, trace = fake_gpu
    model, master, ref_opt = _on_fake_gpu_with_reference(gpu, torch.float32)
    release = _gated_gpu_worker(monkeypatch)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    worker = opt._gpu_in_backward  # holds the optimizer weakly
    gc.collect()
    gc.disable()
    try:
        _loss(model, 0).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.clone()
        dropped = weakref.ref(opt)
        del opt
        assert dropped() is not None  # its queued updates hold it
        release.set()
        worker.idle()
        assert dropped() is None
    finally:
        release.set()
        gc.enable()
    assert compute.ops[-1][1] == "wait"  # the next forward waits for the copies (on the GPU)
    compute.run_until(len(compute.ops))
    ref_opt.step()
    _assert_matches(model, master)


def test_a_gpu_in_backward_optimizer_dropped_in_the_middle_of_backward_updates_every_parameter(fake_gpu):
    # Dropped once the last layer's gradients reached it (its worker idle): the backward holds it until it ends.
    import gc
    import weakref
    gpu, compute, sides, trace = fake_gpu
    model, master, ref_opt = _on_fake_gpu_with_reference(gpu, torch.float32)
    held = [swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)]
    worker, dropped = held[0]._gpu_in_backward, weakref.ref(held[0])

    def drop(grad):
        worker.idle()  # the last layer is updated: nothing of the worker holds the optimizer
        held.clear()
        assert dropped() is not None
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    gc.collect()
    gc.disable()
    try:
        h = model[0](x)
        h.register_hook(drop)
        model[2](model[1](h)).float().square().mean().backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.clone()
        worker.idle()
        assert not held and dropped() is None
    finally:
        gc.enable()
    compute.run_until(len(compute.ops))
    ref_opt.step()
    _assert_matches(model, master)


def test_a_failed_update_of_a_dropped_gpu_in_backward_optimizer_is_a_warning(fake_gpu, monkeypatch):
    # No step() is left to raise it, and no offloaded model's forward to: a SwapioWarning, not silence.
    import gc
    gpu, compute, sides, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    release = _gated_gpu_worker(monkeypatch)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    worker = opt._gpu_in_backward
    monkeypatch.setattr(swapio.optim.cpu_state.CpuState, "_empty",
                        lambda self, name, p: (_ for _ in ()).throw(MemoryError("pinned memory refused")))
    warned = []
    monkeypatch.setattr(swapio.optim.gpu_in_backward.warnings, "warn", lambda *a, **k: warned.append(a))
    gc.collect()
    gc.disable()
    try:
        _loss(model, 0).backward()
        del opt
        release.set()
        worker.idle()
    finally:
        release.set()
        gc.enable()
    hits = [w for w in warned if "dropped" in str(w[0])]
    assert len(hits) == 1 and "MemoryError" in hits[0][0] and hits[0][1] is swapio.SwapioWarning


@pytest.mark.parametrize("lets_go", ["close", "add_param_group"])
def test_the_gradient_arena_is_let_go_only_after_the_copies_into_it_after_zero_grad(fake_gpu, lets_go):
    # backward queues each GPU gradient's copy into the pinned arena; zero_grad() without step() (a skipped step)
    # forgets which gradients were copied, but not the copies: the arena may not be freed (close) or replaced (a new
    # parameter grows it) while the GPU may still write into it
    gpu, compute, sides, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu")
    _loss(model, 0).backward()
    d2h = sides["to_host"]
    assert d2h.ran < len(d2h.ops)  # the copies into the arena are queued, not run
    opt.zero_grad()
    if lets_go == "close":
        opt.close()
    else:
        extra = torch.nn.Parameter(torch.zeros(16))
        gpu.add(extra.detach())
        opt.add_param_group({"params": [extra]})
        assert opt._grad_copies.arena is None  # the old arena is let go
    assert d2h.ran == len(d2h.ops)  # ... after the copies into it ran
    if lets_go != "close":
        opt.close()


def test_in_backward_the_temporary_of_a_non_contiguous_gpu_parameter_is_the_copy_streams_memory(fake_gpu, monkeypatch):
    # The worker updates a non-contiguous parameter (a transposed weight) through a contiguous temporary that the
    # copy stream writes after the gradient's copy only. Allocated on the worker's current stream, the caching
    # allocator could give it a block that kernels of the rest of backward, queued on that stream, still use: the
    # copy would overwrite it under them. Allocated on the copy stream, it gets only memory that stream is done with.
    gpu, compute, sides, trace = fake_gpu
    on_side, allocated = [False], {}  # storage address -> allocated while the copy stream was current
    real_empty, fake_copy_async = torch.empty, cuda_copy.copy_async

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        allocated[t.untyped_storage().data_ptr()] = on_side[0]
        return t

    @contextlib.contextmanager
    def stream(s):
        before, on_side[0] = on_side[0], s is not compute
        try:
            yield
        finally:
            on_side[0] = before

    writes_into_temporaries = []

    def copy_async(dst, src, stream, wait_for=None, hold=True):
        ptr = dst.untyped_storage().data_ptr()
        if stream is sides["to_device"] and not any(ptr == g.untyped_storage().data_ptr() for g in gpu):
            writes_into_temporaries.append(allocated.get(ptr))
        return fake_copy_async(dst, src, stream, wait_for, hold)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(cuda_copy, "copy_async", copy_async)
    model = _model(torch.float32)
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().t().contiguous().t())  # transposed strides
    gpu.update(p.detach() for p in model.parameters())
    master = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2)
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    for step in range(2):
        _loss(model, step).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.clone()
        opt.step()
        compute.run_until(len(compute.ops))
        ref_opt.step()
        _assert_matches(model, master)
        opt.zero_grad()
    assert writes_into_temporaries and all(writes_into_temporaries)  # the copy stream's own memory, each time
    opt.close()


def test_a_dropped_optimizer_lets_its_gradient_arena_go_only_after_the_copies_into_it(fake_gpu):
    # optimizer dropped right after backward (a notebook rebuilding it): the copies backward queued into its
    # pinned gradient arena may still run on the GPU, so the arena lives until they have (the fixture checks it)
    gpu, compute, sides, trace = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu")
    _loss(model, 0).backward()
    assert sides["to_host"].ran < len(sides["to_host"].ops)
    del opt
    gc.collect()
