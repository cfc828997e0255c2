"""opt.state_dict() and opt.load_state_dict() of an in_backward=True optimizer called between backward and step():
backward returns before its worker has updated the last modules, so both must wait for those updates (as save()
does), or the state read is missing them, and the state loaded is overwritten by them (nvme: the worker read the
swap file while load replaced it). The worker is held with a gate (an event in OffloadedParams.update) until the
call is seen either to have returned or to wait for the worker: no sleeps. The reference is the same swapio
optimizer stepping a resident copy."""
import copy
import threading

import pytest
import torch

from swapio.offload import remove_offload
from swapio.optim.offloaded import OffloadedParams
from swapio.optim.worker import UpdateWorker
from helpers.offload_training import (MLP, assert_same_weights, batches, build_opt, loss_of, make_model, offload,
                                      one_thread, train, weights)

pytest.importorskip("safetensors")


@pytest.fixture
def held(monkeypatch):
    """held.hold(): the in_backward worker's updates wait from now on; held(fn): runs fn() on a thread, and lets the
    updates go on once fn() returned or waits for the worker. Returns fn()'s result."""
    gate = threading.Event()
    gate.set()
    real_update, real_idle = OffloadedParams.update, UpdateWorker.idle

    def update(self, *args, **kw):
        gate.wait()
        return real_update(self, *args, **kw)

    decided = threading.Event()
    caller = []

    def idle(self):
        if threading.current_thread() in caller:
            decided.set()  # fn() waits for the worker: let the updates run
        return real_idle(self)
    monkeypatch.setattr(OffloadedParams, "update", update)
    monkeypatch.setattr(UpdateWorker, "idle", idle)

    def run(fn):
        out, error = [], []

        def body():
            try:
                out.append(fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error.append(exc)
            finally:
                decided.set()
        thread = threading.Thread(target=body)
        caller.append(thread)
        thread.start()
        decided.wait()
        gate.set()
        thread.join()
        caller.clear()
        decided.clear()
        if error:
            raise error[0]
        return out[0]
    run.hold = gate.clear
    yield run
    gate.set()


def assert_same_state(got, want):
    """Equal state; an offloaded fp32 weight's state also holds its "master" (a resident one is its own)."""
    assert got["state"].keys() == want["state"].keys()
    for i, fields in want["state"].items():
        assert got["state"][i].keys() - {"master"} == fields.keys() - {"master"}, i
        for k, v in fields.items():
            if k in got["state"][i]:
                assert torch.equal(got["state"][i][k], v), (i, k)


@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_state_dict_between_backward_and_step_holds_the_updates_of_that_backward(tmp_path, held, off):
    data = batches(MLP, 1)
    ref = make_model()
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref", offload=off)
    train(ref, ref_opt, data)
    model = offload(make_model(), "disk", tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off, in_backward=True)
    held.hold()
    with one_thread():
        loss_of(model, data[0]).backward()
    got = held(opt.state_dict)  # every module's gradient was complete: backward updated them all
    assert_same_state(got, ref_opt.state_dict())
    names = [n for n, _ in model.named_parameters()]
    for i, (n, p) in enumerate(ref.named_parameters()):
        assert torch.equal(got["state"][names.index(n)]["master"], p.detach()), n
    opt.step()
    opt.close()
    ref_opt.close()


@pytest.mark.parametrize("off", ["cpu", "nvme"])
def test_load_state_dict_between_backward_and_step_is_not_overwritten_by_that_backward(tmp_path, held, off):
    """A rewind: the state of step 1 loaded after step 2's backward; the run then goes on as one that skipped
    data[1]."""
    data = batches(MLP, 3)
    ref = make_model()
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref", offload=off)
    train(ref, ref_opt, [data[0], data[2]])
    model = offload(make_model(), "disk", tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off, in_backward=True)
    train(model, opt, data[:1])
    first = copy.deepcopy(opt.state_dict())  # cpu mode: the live state, as torch's
    held.hold()
    with one_thread():
        loss_of(model, data[1]).backward()
    held(lambda: opt.load_state_dict(first))
    opt.zero_grad()
    assert_same_state(opt.state_dict(), first)
    train(model, opt, data[2:])
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    opt.close()
    ref_opt.close()
    remove_offload(model)
    assert_same_weights(weights(model), weights(ref))


@pytest.mark.parametrize("storage,off", [("disk", "nvme"), ("cpu", "cpu")])
def test_weights_read_between_backward_and_step_are_those_backward_updated(tmp_path, held, storage, off):
    """opt.param_value(p) and save_checkpoint(model) read the weights after every update that backward began."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from swapio.offload import save_checkpoint
    data = batches(MLP, 1)
    ref = make_model()
    ref_opt = build_opt("AdamW", ref.parameters(), tmp_path / "ref", offload=off)
    train(ref, ref_opt, data)
    want = weights(ref)
    model = offload(make_model(), storage, tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "swap", offload=off, in_backward=True)
    named = dict(model.named_parameters())
    for how in ("param_value", "save_checkpoint"):
        held.hold()
        with one_thread():
            loss_of(model, data[0]).backward()
        if how == "param_value":
            got = held(lambda: {n: opt.param_value(p) for n, p in named.items()})
        else:
            path = tmp_path / "export.safetensors"
            held(lambda: save_checkpoint(model, path))
            got = safetensors_torch.load_file(str(path))
        assert_same_weights(got, want)
        opt.step()  # nothing left: backward updated every weight
        opt.zero_grad()
        train(ref, ref_opt, data)  # the next round's step
        want = weights(ref)
    opt.close()
    ref_opt.close()
    remove_offload(model)
