"""A thread that checkpoints (state_dict(), save()) while the training thread steps, as async checkpointing
code does. The nvme pipeline's slots and its record of the writes that finished are the optimizer's one set: a
state_dict() run in the middle of a step reset that record, so the step's parameters were marked half-stepped
(every later step, export and save refused) or a record was written back holding the other's data. The
checkpointing thread now waits for the step, and the step goes on as if it were alone."""
import threading

import pytest
import torch

import swapio.optim as so
from swapio import ops
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401

N = 40000  # several 64 KiB chunks a parameter (SMALL_BUFFERS)


def _run(mode, tmp_path, name, during=None, monkeypatch=None):
    """Steps 0..3 of an OffloadAdamW; during(opt) runs on another thread from inside the kernel's first call of
    step 2, which waits (at most a second) for it to end before going on."""
    params = [torch.randn(N, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(3)]
    extra = {"swap_dir": tmp_path / name, **SMALL_BUFFERS} if mode == "nvme" else {}
    opt = so.OffloadAdamW(params, lr=1e-2, offload=mode, cpu_threads=1, **extra)
    outcome = {}
    for k in range(4):
        if k == 2 and during is not None:
            real, calls = ops.adam_step_, []

            def kernel(*args, **kwargs):
                if not calls:
                    calls.append(1)
                    done = threading.Event()

                    def other():
                        try:
                            outcome["value"] = during(opt)
                        except BaseException as exc:  # noqa: BLE001 - checked below
                            outcome["error"] = exc
                        done.set()

                    outcome["thread"] = threading.Thread(target=other)
                    outcome["thread"].start()
                    done.wait(1.0)  # it runs to its end here, or waits for the step (a bound, not a check)
                return real(*args, **kwargs)

            monkeypatch.setattr(ops, "adam_step_", kernel)
        for i, p in enumerate(params):
            p.grad = torch.randn(N, generator=torch.Generator().manual_seed(10 * k + i))
        opt.step()
        if k == 2 and during is not None:
            monkeypatch.undo()
            outcome["thread"].join()
    return opt, params, outcome


def _snapshot(opt):
    sd = opt.state_dict()
    return {i: {k: t.clone() for k, t in st.items()} for i, st in sd["state"].items()}


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("what", ["state_dict", "save"])
def test_a_checkpoint_taken_by_another_thread_during_a_step_is_whole_and_the_step_unharmed(what, mode, tmp_path,
                                                                                         monkeypatch):
    ref, ref_params, _ = _run(mode, tmp_path, "ref")
    take = (lambda opt: _snapshot(opt)) if what == "state_dict" else (lambda opt: opt.save(tmp_path / "ckpt"))
    opt, params, outcome = _run(mode, tmp_path, "ours", during=take, monkeypatch=monkeypatch)
    assert "error" not in outcome, outcome.get("error")
    for p, q in zip(params, ref_params):
        assert torch.equal(p.detach(), q.detach())
    assert _snapshot(opt).keys() == _snapshot(ref).keys()
    for i, st in _snapshot(ref).items():
        for name, t in st.items():
            assert torch.equal(_snapshot(opt)[i][name], t), (i, name)
    # what the other thread took is the state after a whole step (step 3 of 4), never a mix
    if what == "save":
        opt.load(tmp_path / "ckpt")
        taken = _snapshot(opt)
    else:
        taken = outcome["value"]
    assert {float(st["step"]) for st in taken.values()} == {3.0}
    for o in (ref, opt):
        o.close()


def test_close_from_another_thread_waits_for_the_step_in_progress(tmp_path, monkeypatch):
    """close() on one thread while another was inside an nvme step() closed the swap file's handles under the
    step, which failed with "the handle is closed" or an AttributeError. close() now waits for the step to end;
    the next step says the optimizer is closed, and nothing is left in swap_dir."""
    params = [torch.randn(N, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(3)]
    opt = so.OffloadAdamW(params, lr=1e-2, offload="nvme", swap_dir=tmp_path, cpu_threads=1, **SMALL_BUFFERS)
    for p in params:
        p.grad = torch.ones(N)
    opt.step()
    real, closer = ops.adam_step_, []

    def kernel(*args, **kwargs):
        if not closer:
            closer.append(threading.Thread(target=opt.close))
            closer[0].start()
            closer[0].join(1.0)  # it closes here, or waits for the step (a bound, not a check)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "adam_step_", kernel)
    opt.step()  # whole, though close() was called during it
    monkeypatch.undo()
    closer[0].join()
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    assert list(tmp_path.iterdir()) == []
