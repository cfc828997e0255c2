"""Flags take numpy's bool (what comparing numpy numbers gives: verify=size > limit) as torch and Python take it;
they refused it as "must be True or False, got bool". An int or a str there stays a TypeError naming the flag
(offload.stats took any reset=: "False" zeroed the counters; swap_out any release=: "False" freed the memory)."""
import pytest
import torch

swapio = pytest.importorskip("swapio")
np = pytest.importorskip("numpy")


def _handle(call):
    h = swapio.AioHandle()
    try:
        call(h)
    finally:
        h.close()


def _store(tmp, call):
    with swapio.SwapStore(tmp / "s") as store:
        call(store)


def _optimizer(call=lambda opt: None, **kw):
    opt = swapio.optim.OffloadAdamW(torch.nn.Linear(2, 2).parameters(), **kw)
    try:
        call(opt)
    finally:
        opt.close()


FLAGS = {
    "verify": lambda tmp, v: swapio.SwapStore(tmp / "s", verify=v).close(),
    "direct": lambda tmp, v: swapio.AioHandle(direct=v).close(),
    "release": lambda tmp, v: _store(tmp, lambda s: s.swap_out(torch.ones(4), release=v).wait()),
    "staged": lambda tmp, v: _handle(lambda h: h.pwrite(torch.ones(4), tmp / "f", staged=v).wait()),
    "restores": lambda tmp, v: _handle(lambda h: (h.pwrite(torch.ones(4), tmp / "f").wait(),
                                                   h.pread(torch.empty(4), tmp / "f", restores=v).wait())),
    "in_backward": lambda tmp, v: _optimizer(in_backward=v),
    "reset (step_report)": lambda tmp, v: _optimizer(lambda opt: opt.step_report(reset=v)),
    "reset (offload.stats)": lambda tmp, v: swapio.offload.stats(
        swapio.offload.cpu_offload(torch.nn.Linear(2, 2), "cpu"), reset=v),
    "offload_buffers": lambda tmp, v: swapio.offload.remove_offload(
        swapio.offload.cpu_offload(torch.nn.Linear(2, 2), "cpu", offload_buffers=v)),
    "progress": lambda tmp, v: swapio.offload.remove_offload(
        swapio.offload.disk_offload(torch.nn.Linear(2, 2), tmp / "od", "cpu", progress=v)),
}


@pytest.mark.parametrize("value", [np.True_, np.False_], ids=["np.True_", "np.False_"])
@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_a_numpy_bool_is_taken(tmp_path, flag, value):
    FLAGS[flag](tmp_path, value)


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_an_int_is_still_a_type_error_naming_the_flag(tmp_path, flag):
    with pytest.raises(TypeError, match=f"^{flag.split()[0]} must be .*got int$"):
        FLAGS[flag](tmp_path, 1)
