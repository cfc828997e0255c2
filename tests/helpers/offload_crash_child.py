"""The child side of test_offload_faults: imported once by the fork server (preload), so each child starts warm.

The model: frozen layers offloaded to disk and a small trainable low-rank adapter kept resident (frozen-weight
fine-tuning, as with LoRA). A child loops over one phase (disk_offload + remove_offload, forward, or forward +
backward) and counts the points it passes (Points); at the point the parent chose, it tells the parent and waits
there for the parent's signal, so each signal lands at a known point. After a Ctrl-C the child itself checks that
the model still works as the resident one does; after a SIGKILL the parent checks the directory it left
(check_next_use)."""
import os
import signal
import time
import traceback

import torch

from swapio import _progress
from swapio.offload import disk_offload, remove_offload
from swapio.offload.registry import offloaded as _offloaded

WIDTH, DEPTH, RANK = 512, 12, 4  # twelve 1 MiB layers: disk_offload writes 12 MiB
INDEX = "swapio-weights.json"
ITERATIONS = 2  # the points of this many rounds of the phase's loop are counted
# Points per round: disk_offload's write (its progress bar made, advanced, closed) for "offload"; each layer's
# forward for "forward"; those and the gradients of the adapter's two outputs for "backward" (the frozen layers
# get none).
POINTS = {"offload": 3 * ITERATIONS, "forward": DEPTH * ITERATIONS, "backward": (DEPTH + 2) * ITERATIONS}
WAIT = 120  # seconds a child waits at its point for the parent's signal


class Adapted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)).requires_grad_(False)
        self.down = torch.nn.Linear(WIDTH, RANK, bias=False)
        self.up = torch.nn.Linear(RANK, WIDTH, bias=False)
        torch.nn.init.normal_(self.up.weight)

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h + self.up(self.down(h))


def inputs():
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))


def run(model):
    """(output, the adapter's gradients) of one forward and backward."""
    out = model(inputs())
    grads = torch.autograd.grad(out.square().sum(), [model.down.weight, model.up.weight])
    return out.detach(), grads


def offload(model, directory):
    return disk_offload(model, directory, keep_resident=["down", "up"], buffer_bytes=3 << 20, prefetch=1)


def same(got, want):
    return torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def check_works(model, directory, want, interrupted_backward=False):
    """The model (offloaded or, after an interrupted disk_offload/remove_offload, resident) computes what the
    resident model does, offloaded and again after remove_offload; the directory then holds only the offload."""
    if model not in _offloaded:
        assert all(p.device.type == "cpu" for p in model.parameters()), "neither offloaded nor resident"
        assert same(run(model), want), "the model left resident computes something else"
        offload(model, directory)
    assert same(run(model), want), "the offloaded model computes something else"
    engine = _offloaded[model]  # and, that call done, no module holds its weights or left hooks behind
    assert all(u.depth == 0 and not u.fetches and not u.hooks_entered for u in engine.units), "a module stays entered"
    if not interrupted_backward:  # a Ctrl-C inside backward's refetch can keep one fetch held: docs/offload.md
        assert all(f.users == 0 for f in engine.fetcher.fetches.values()), "a fetch is still in use"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "saved-tensor hooks left installed"
    remove_offload(model)
    assert same(run(model), want), "the model after remove_offload computes something else"
    names = sorted(os.listdir(directory))
    data = [n for n in names if n.startswith("swapio-weights-")]
    assert names == sorted([INDEX, *data]) and len(data) == 1, f"left behind in {directory}: {names}"


class Points:
    """Counts the points the child passes; at point number `target` it sends to `ready` and waits for the
    parent's signal (a Ctrl-C raises KeyboardInterrupt right there; a SIGKILL ends the process there)."""

    def __init__(self, target, ready):
        self.count, self.target, self.ready = 0, target, ready

    def __call__(self, *args):
        self.count += 1
        if self.count == self.target:
            self.ready.send(self.count)
            time.sleep(WAIT)
            raise RuntimeError(f"no signal came within {WAIT} s of point {self.target}")


class _PointBar:
    """disk_offload's progress bar (swapio._progress.bar): made, advanced and closed inside its write."""

    def __init__(self, point):
        self.point = point
        point()

    def update(self, n=1):
        self.point()

    def close(self):
        self.point()


def _install(model, phase, point):
    """Puts `point` on the phase's points; returns the function that takes it off again."""
    if phase == "offload":
        real = _progress.bar
        _progress.bar = lambda *args, **kwargs: _PointBar(point)
        return lambda: setattr(_progress, "bar", real)
    hooks = [layer.register_forward_pre_hook(point) for layer in model.layers]
    if phase == "backward":
        def on_output(module, args, out):
            out.register_hook(point)  # (returns None: a forward hook's result would replace the output)

        hooks += [m.register_forward_hook(on_output) for m in (model.down, model.up)]
    return lambda: [h.remove() for h in hooks]


def child(phase, directory, target, ready, result):
    """Loops over `phase` until the parent's signal, which comes at point number `target` (see Points); after a
    Ctrl-C, checks the model (result 1: works, 2: does not)."""
    # Ctrl-C raises here even when the test runs where SIGINT is ignored (a background job), which the fork
    # server and its children would otherwise inherit.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    want = run(Adapted())
    model = Adapted()
    if phase != "offload":
        offload(model, directory)
    uninstall = _install(model, phase, Points(target, ready))
    try:
        for _ in range(ITERATIONS):
            if phase == "offload":
                offload(model, directory)
                remove_offload(model)
            elif phase == "forward":
                with torch.no_grad():
                    model(inputs())
            else:
                run(model)
        raise RuntimeError(f"the loop ended before point {target}")
    except KeyboardInterrupt:
        pass
    finally:
        uninstall()
    try:
        check_works(model, directory, want, interrupted_backward=phase == "backward")
        result.value = 1
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        traceback.print_exc()
        result.value = 2


def check_next_use(directory, reuse):
    """After a SIGKILL: the next model offloaded to the directory (writing its weights, or, with `reuse` and a
    committed offload there, a model whose layers are on meta reading them) works, and leftovers are gone."""
    want = run(Adapted())
    model = Adapted()
    if reuse and os.path.exists(os.path.join(directory, INDEX)):
        model.layers.to("meta")
    offload(model, directory)
    check_works(model, directory, want)


Adapted()  # warm up: the first model of a process pays for lazy initialisation
