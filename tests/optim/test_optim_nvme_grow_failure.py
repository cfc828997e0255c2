"""nvme mode: the swap file's growth failing when parameters are placed (ENOSPC at the first step, or at the
first step after add_param_group). The step raises; retried once there is room, the run goes on as torch's.
Before, the chunks kept the offsets given before the failure while the file's recorded end did not move, so
the next parameters placed were given records over them, and the resize to that shorter end cut off records
already written: a read past the end of the file, or one parameter's moments read as another's."""
import errno

import pytest
import torch

import swapio.optim as so
from swapio.core import _swapdir
from helpers.optim import SMALL_BUFFERS, one_thread  # noqa: F401

N = 5000  # elements a parameter: several 64 KiB chunks (SMALL_BUFFERS)


def _grad(k, i):
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * k + i))


@pytest.mark.parametrize("failing", [1, 2], ids=["first placement", "placement after add_param_group"])
def test_a_failed_growth_of_the_swap_file_retried_steps_as_torch(failing, tmp_path, monkeypatch):
    params = [torch.randn(N, generator=torch.Generator().manual_seed(i)).requires_grad_(True) for i in range(4)]
    ref = [p.detach().clone().requires_grad_(True) for p in params]
    ours = so.OffloadAdamW(params[:2], lr=1e-2, offload="nvme", swap_dir=tmp_path, **SMALL_BUFFERS)
    theirs = torch.optim.AdamW(ref[:2], lr=1e-2, foreach=False)
    real, calls = _swapdir.resize_private_file, {"n": 0}

    def full_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(_swapdir, "resize_private_file", full_once)
    failed = 0
    for k in range(5):
        if k in (2, 3):  # parameters placed later: each a growth of the file
            ours.add_param_group({"params": [params[k]], "lr": 5e-3})
            theirs.add_param_group({"params": [ref[k]], "lr": 5e-3})
        for i, (p, q) in enumerate(zip(params, ref)):
            p.grad = _grad(k, i)
            q.grad = p.grad.clone()
        try:
            ours.step()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            failed += 1
            ours.step()  # room was made: the step again
        theirs.step()
    assert failed == 1
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-6)
    sd, ref_sd = ours.state_dict(), theirs.state_dict()
    for i in ref_sd["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][name], ref_sd["state"][i][name], rtol=1e-6, atol=1e-7)
    ours.close()
