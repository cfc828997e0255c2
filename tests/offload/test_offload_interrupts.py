"""Ctrl-C inside an offloaded forward, failures while attaching, concurrent forwards and copies: the model is always left working or as it was, never half offloaded."""
import copy
import os
import pickle
import signal
import threading

import pytest
import torch

import swapio.offload.api as offload_api
from swapio.offload import cpu_offload, cpu_offload_with_hook, disk_offload, remove_offload
from swapio.offload.api import _offloaded
from swapio.offload.fetch import Fetcher
from helpers.offload import NEW_TOKENS, assert_same_outputs, one_thread, reference, resident_model

safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.usefixtures("ctrl_c_raises")  # real SIGINTs raise even under an ignoring runner


class Scaled(torch.nn.Module):
    """A unit with a child unit: its own `scale` is in place while the child runs."""

    def __init__(self, width, interrupt=None):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.inner = torch.nn.Linear(width, width)
        self.interrupt = interrupt  # called inside the inner module's forward

    def forward(self, x):
        return self.inner(x) * self.scale


def stack(width=64, depth=4):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Scaled(width) for _ in range(depth)]).requires_grad_(False)


def ctrl_c():
    """A real Ctrl-C: SIGINT to this process, which Python turns into KeyboardInterrupt at the next bytecode."""
    os.kill(os.getpid(), signal.SIGINT)


def interrupt_inside(module):
    """SIGINT from inside module's forward, once."""
    own = module.forward
    fired = []

    def forward(*args, **kwargs):
        if not fired:
            fired.append(1)
            ctrl_c()
        return own(*args, **kwargs)
    module.forward = forward


OFFLOADS = {
    "disk": lambda model, tmp: disk_offload(model, tmp / "od", buffer_bytes=64 << 10),
    "cpu": lambda model, tmp: cpu_offload(model),
}


def assert_nothing_held(model):
    engine = _offloaded[model]
    assert all(u.depth == 0 and not u.fetches and not u.hooks_entered for u in engine.units)
    assert all(f.users == 0 for f in engine.fetcher.fetches.values()) and not engine.live
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # swapio's pack hooks are gone


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_ctrl_c_inside_a_forward_cleans_up_like_an_exception(tmp_path, kind, grad):
    model = stack()
    x = torch.randn(3, 64, requires_grad=grad)
    want = model(x)
    interrupt_inside(model[2].inner)  # a unit inside a unit: both are entered when Ctrl-C arrives
    OFFLOADS[kind](model, tmp_path)
    with torch.set_grad_enabled(grad), pytest.raises(KeyboardInterrupt):
        model(x)
    assert_nothing_held(model)
    with torch.set_grad_enabled(grad):
        got = model(x)  # the next forward works and is right
    assert torch.equal(got, want)
    if grad:
        assert torch.equal(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    remove_offload(model)
    a = torch.randn(5, requires_grad=True)
    (a * a).sum().backward()  # an unrelated backward after remove_offload: no stale saved-tensor hook
    assert torch.equal(a.grad, 2 * a.detach())
    assert torch.equal(model(x), want)


def test_ctrl_c_during_generate_leaves_no_module_holding_the_ring(tmp_path):
    model = disk_offload(resident_model(), tmp_path / "od", buffer_bytes=256 << 10)
    ids = reference()[0]
    calls = {"n": 0}
    target = model.transformer.h[1].mlp.c_fc
    own = type(target).forward

    def forward(self, x):  # Ctrl-C at different depths of generate(): the 3rd, 7th, ... call of this module
        calls["n"] += 1
        if calls["n"] % 4 == 3:
            ctrl_c()
        return own(self, x)
    target.__dict__["forward"].inner = forward.__get__(target)
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt), torch.no_grad(), one_thread():
            model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert_nothing_held(model)
        assert _offloaded[model].fetcher.ring.in_use <= 256 << 10
    target.__dict__["forward"].inner = own.__get__(target)
    assert_same_outputs(model)
    remove_offload(model)


# ---- a failure or Ctrl-C while attaching --------------------------------------------------------------------------
def fail_in(monkeypatch, where, exc):
    def boom(*args, **kwargs):
        raise exc
    if where == "ring":
        monkeypatch.setattr(Fetcher, "prepare", boom)
    elif where == "placeholders":
        monkeypatch.setattr("swapio.offload.streamer.install_placeholders", boom)
    elif where == "register":
        monkeypatch.setattr(offload_api, "_register", boom)
    elif where == "engine":  # cpu_offload: after the host copies replaced the model's tensors
        monkeypatch.setattr(offload_api, "WeightStreamer", boom)


def checkpoint_source(model, tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()
                                 if k != "lm_head.weight"}, str(path))
    return path


ATTACHES = {
    "disk": lambda model, tmp: disk_offload(model, tmp / "od"),
    "checkpoint": lambda model, tmp: disk_offload(model, checkpoint=checkpoint_source(model, tmp)),
    "cpu": lambda model, tmp: cpu_offload(model),
}


@pytest.mark.slow
@pytest.mark.parametrize("exc", [KeyboardInterrupt(), MemoryError("pinned memory")], ids=["ctrl-c", "error"])
@pytest.mark.parametrize("where", ["ring", "placeholders", "register", "engine"])
@pytest.mark.parametrize("kind", list(ATTACHES))
def test_a_failure_while_attaching_leaves_the_model_as_it_was(tmp_path, monkeypatch, kind, where, exc):
    if where == "engine" and kind != "cpu":
        pytest.skip("the host copies are cpu_offload's")
    model = resident_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with monkeypatch.context() as m:
        fail_in(m, where, exc)
        with pytest.raises(type(exc)):
            ATTACHES[kind](model, tmp_path)
    assert model not in _offloaded and not any("forward" in mod.__dict__ for mod in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert model.transformer.wte.weight is model.lm_head.weight  # ties kept
    assert_same_outputs(model)
    with pytest.raises(ValueError, match="not offloaded"):
        remove_offload(model)
    ATTACHES[kind](model, tmp_path)  # offloading again: one set of wrappers, the directory free again
    assert not isinstance(model.transformer.h[0].attn.c_attn.forward.inner, type(model.lm_head.forward))
    assert_same_outputs(model)
    remove_offload(model)
    assert_same_outputs(model)


# ---- concurrent forwards ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_two_threads_forwarding_one_offloaded_model_get_the_resident_outputs(tmp_path, kind):
    ids, logits, _ = reference()
    model = OFFLOADS[kind](resident_model(), tmp_path)
    errors, results = [], []
    barrier = threading.Barrier(3)

    def run(rows):
        try:
            barrier.wait(60)
            for _ in range(15):
                with torch.no_grad():
                    results.append(torch.equal(model(ids[rows]).logits, logits[rows]))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
    with one_thread():
        threads = [threading.Thread(target=run, args=(rows,)) for rows in (slice(0, 1), slice(1, 2), slice(0, 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors[0]
    assert len(results) == 45 and all(results)
    assert_nothing_held(model)
    remove_offload(model)


# ---- copies -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["disk", "cpu", "with_hook"])
def test_copying_an_offloaded_model_is_a_type_error(tmp_path, kind):
    model = resident_model()
    if kind == "with_hook":
        _, hook = cpu_offload_with_hook(model)
    else:
        OFFLOADS[kind](model, tmp_path)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        pickle.dumps(model)
    assert_same_outputs(model)  # the original is unharmed
    remove_offload(model)
    assert_same_outputs(copy.deepcopy(model))  # and can be copied once it is back to normal


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), MemoryError("pinned memory")], ids=["ctrl-c", "error"])
def test_a_failure_in_cpu_offload_with_hook_leaves_the_model_as_it_was(monkeypatch, exc):
    model = resident_model()
    params = list(model.parameters())
    with monkeypatch.context() as m:
        m.setattr(offload_api, "_register", lambda *a: (_ for _ in ()).throw(exc))
        with pytest.raises(type(exc)):
            cpu_offload_with_hook(model)
    assert not model._forward_pre_hooks and model not in _offloaded
    assert list(model.parameters()) == params
    assert_same_outputs(model)
    _, hook = cpu_offload_with_hook(model)
    assert len(model._forward_pre_hooks) == 1
    hook.remove()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_state_left_by_a_ctrl_c_inside_swapio_itself_is_healed_by_the_next_call(tmp_path, grad):
    """Python delivers Ctrl-C between any two bytecodes, also inside swapio's own enter/leave; whatever a call
    left there, nobody runs the module when the next call starts, so that call cleans it up first."""
    model = stack()
    x = torch.randn(3, 64)
    want = model(x)
    disk_offload(model, tmp_path / "od", buffer_bytes=64 << 10)
    engine = _offloaded[model]
    with torch.set_grad_enabled(grad):
        engine.enter(engine.units[1])  # as if Ctrl-C landed just after enter(), before the forward ran
        engine.units[2].depth = 1      # or just after the depth count went up
    assert torch.equal(model(x), want)
    assert_nothing_held(model)
    remove_offload(model)


@pytest.mark.parametrize("after", [False, True], ids=["before-push", "after-push"])
def test_ctrl_c_around_installing_the_saved_tensor_hooks_leaves_none_installed(tmp_path, monkeypatch, after):
    """A Ctrl-C just before or just after swapio pushes its saved-tensor hooks (the CI's random-interrupt matrix
    once hit the gap between the push and its record: the hooks stayed installed for every later backward)."""
    model = stack()
    x = torch.randn(3, 64, requires_grad=True)
    want = model(x)
    disk_offload(model, tmp_path / "od", buffer_bytes=64 << 10)
    real = torch._C._autograd._push_saved_tensors_default_hooks
    calls = []

    def push_then_interrupt(pack, unpack):
        calls.append(1)
        if after:
            real(pack, unpack)
        if len(calls) == 2:  # the second unit entered: one is entered below it
            raise KeyboardInterrupt
        if not after:
            real(pack, unpack)

    monkeypatch.setattr(torch._C._autograd, "_push_saved_tensors_default_hooks", push_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    monkeypatch.undo()
    assert_nothing_held(model)
    got = model(x)
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    remove_offload(model)


def test_ctrl_c_inside_remove_offload_leaves_the_model_offloaded_and_working(tmp_path, monkeypatch):
    model = stack()
    x = torch.randn(3, 64)
    want = model(x)
    disk_offload(model, tmp_path / "od", buffer_bytes=64 << 10)
    engine = _offloaded[model]
    real, calls = engine.fetcher.acquire, []

    def acquire(record):  # Ctrl-C while remove_offload reads the third record
        calls.append(record)
        if len(calls) == 3:
            ctrl_c()
        return real(record)
    monkeypatch.setattr(engine.fetcher, "acquire", acquire)
    with pytest.raises(KeyboardInterrupt):
        remove_offload(model)
    monkeypatch.undo()
    assert model in _offloaded
    with torch.no_grad():
        assert torch.equal(model(x), want)
    remove_offload(model)
    assert torch.equal(model(x), want)


def test_ctrl_c_while_remove_offload_frees_the_ring_still_frees_everything(tmp_path, monkeypatch):
    """A Ctrl-C landing while remove_offload's close waits for the reads and writes in flight (the fetcher's
    drain) ended that clean-up there, and it runs once: the handle stayed open and the offload_dir claimed
    (another disk_offload of it: EBUSY) until the streamer was collected. It is raised once all is freed."""
    model = stack()
    x = torch.randn(3, 64)
    want = model(x)
    disk_offload(model, tmp_path / "od", buffer_bytes=64 << 10)
    engine = _offloaded[model]
    real = engine.fetcher.drain

    def drain():
        ctrl_c()
        return real()
    monkeypatch.setattr(engine.fetcher, "drain", drain)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        remove_offload(model)
    # (checked while the exception, and so remove_offload's frames, live: the clean-up is done, not left to them)
    assert model not in _offloaded and torch.equal(model(x), want)
    assert engine.fetcher.ring is None or engine.fetcher.ring._arena is None
    again = stack()
    disk_offload(again, tmp_path / "od", buffer_bytes=64 << 10)  # the directory is free for another model
    with torch.no_grad():
        assert torch.equal(again(x), want)
    del interrupted
    remove_offload(again)


def test_an_offloaded_modules_forward_keeps_its_signature(tmp_path):
    """transformers inspects forward's signature (generate() checks which inputs a model takes)."""
    import inspect
    model = torch.nn.Linear(8, 8)
    want = inspect.signature(model.forward)
    disk_offload(model, tmp_path / "od")
    assert inspect.signature(model.forward) == want
    remove_offload(model)


class InterruptedRead:
    """A read's future whose first exception() raises KeyboardInterrupt (Ctrl-C while it is waited for)."""

    def __init__(self, future):
        self.future, self.fired = future, False

    def exception(self, timeout=None):
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return self.future.exception(timeout)

    def wait(self, timeout=None):
        return self.future.wait(timeout)

    def done(self):
        return self.future.done()


def ring_accounted(fetcher):
    """The ring's bytes in use are those of the fetches in the table (none lost to an interrupted drop)."""
    from swapio.offload.layout import round_up
    return fetcher.ring.in_use == sum(round_up(f.record.nbytes) for f in fetcher.fetches.values()
                                      if f.alloc[0] == "ring")


def test_ctrl_c_while_dropping_a_read_ahead_keeps_its_ring_region_accounted_for(tmp_path):
    """A fetch read ahead is dropped (to make room, or by remove_offload) only once its reads finished; a Ctrl-C
    during that wait used to leave it out of the table with its ring region still taken, for good."""
    model = stack()
    x = torch.randn(3, 64)
    want = model(x)
    disk_offload(model, tmp_path / "od", buffer_bytes=64 << 10)
    assert torch.equal(model(x), want)
    fetcher = _offloaded[model].fetcher
    record = next(r for u in _offloaded[model].units for r in u.records if r not in fetcher.fetches)
    fetch = fetcher.start(record, copy=False)
    assert fetch.alloc[0] == "ring" and fetch.reads
    fetch.reads[0] = InterruptedRead(fetch.reads[0])
    with pytest.raises(KeyboardInterrupt):
        fetcher.drain()
    assert ring_accounted(fetcher)
    assert torch.equal(model(x), want)
    assert ring_accounted(fetcher) and fetcher.stats["temp"] == 0
    remove_offload(model)
    assert torch.equal(model(x), want)
