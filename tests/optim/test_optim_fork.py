"""fork() after an nvme optimizer was made (DataLoader workers, multiprocessing pools started by fork): the swap
file stays the parent's. A child that uses the optimizer gets a RuntimeError saying so before anything touches
the file; the parent's file is left byte for byte as it was and the parent goes on as torch's AdamW. Before, a
child's load_state_dict() renamed a new file over the parent's (whose next step failed with "another file
replaced the file expected here"), and a child's step grew it."""
import copy
import hashlib

import pytest
import torch

import swapio.optim as so
from helpers.fork import run_in_child
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401

N = 5000


def _feed(params, ref, k):
    for i, (p, q) in enumerate(zip(params, ref)):
        p.grad = torch.randn(N, generator=torch.Generator().manual_seed(10 * k + i))
        q.grad = p.grad.clone()


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


CHILD_USES = {
    "step": lambda opt, params, groups, tmp: opt.step(),
    "step a new parameter": lambda opt, params, groups, tmp: (
        opt.add_param_group({"params": [torch.ones(4 * N, requires_grad=True)]}),
        setattr(opt.param_groups[-1]["params"][0], "grad", torch.ones(4 * N)), opt.step()),
    "load_state_dict": lambda opt, params, groups, tmp: opt.load_state_dict({"state": {}, "param_groups": groups}),
    "state_dict": lambda opt, params, groups, tmp: opt.state_dict(),
    "save": lambda opt, params, groups, tmp: opt.save(tmp / "child-ckpt"),
}


@pytest.mark.parametrize("use", CHILD_USES.values(), ids=CHILD_USES.keys())
def test_a_forked_child_cannot_use_the_parents_nvme_optimizer(use, tmp_path):
    params = [torch.randn(N, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(2)]
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    ours = so.OffloadAdamW(params, lr=1e-2, offload="nvme", swap_dir=tmp_path / "swap", **SMALL_BUFFERS)
    theirs = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    _feed(params, ref, 0)
    ours.step()
    theirs.step()
    groups = copy.deepcopy(ours.state_dict()["param_groups"])
    swap_file = ours.swap_path + "/state.swap"
    before = _digest(swap_file)
    _feed(params, ref, 1)

    def child():
        with pytest.raises(RuntimeError, match=r"swap file belongs to process \d+.*forked"):
            use(ours, params, groups, tmp_path)

    assert run_in_child(child) == 0
    assert _digest(swap_file) == before
    assert not (tmp_path / "child-ckpt").exists()
    ours.step()
    theirs.step()
    _feed(params, ref, 2)
    ours.step()
    theirs.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    ours.close()


@pytest.mark.parametrize("busy", [True, False], ids=["another-thread-checkpointing", "idle"])
def test_a_forked_child_of_a_cpu_optimizer_steps_or_says_why_not(busy, tmp_path):
    """BUG: fork() while another thread was inside the optimizer (a checkpoint thread's state_dict(), here held in
    a state_dict pre-hook) copied its lock as held, and a child that then stepped the cpu-mode optimizer hung for
    good. The child now gets a RuntimeError naming the fork (its copy of the state may be half-changed); forked
    while nobody used it, the child steps as torch does. The parent goes on as torch's AdamW either way."""
    import threading
    params = [torch.randn(N, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(2)]
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    ours = so.OffloadAdamW(params, lr=1e-2, offload="cpu")
    theirs = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    _feed(params, ref, 0)
    ours.step()
    theirs.step()
    inside, leave = threading.Event(), threading.Event()
    ours.register_state_dict_pre_hook(lambda opt: (inside.set(), leave.wait(30)))
    checkpointing = threading.Thread(target=ours.state_dict)
    if busy:
        checkpointing.start()
        assert inside.wait(30)
    _feed(params, ref, 1)

    def child():
        if busy:
            with pytest.raises(RuntimeError, match=r"(?s)in use on another thread.*forked"):
                ours.step()
        else:
            want = [q.detach().clone().requires_grad_(True) for q in ref]
            torch_opt = torch.optim.AdamW(want, lr=1e-2, foreach=False)
            torch_opt.load_state_dict(theirs.state_dict())
            for w, q in zip(want, ref):
                w.grad = q.grad.clone()
            ours.step()
            torch_opt.step()
            for p, w in zip(params, want):
                torch.testing.assert_close(p.detach(), w.detach(), rtol=1e-6, atol=1e-7)

    try:
        assert run_in_child(child) == 0
    finally:
        leave.set()
        if busy:
            checkpointing.join(30)
    ours.step()
    theirs.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
