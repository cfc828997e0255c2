"""A process training offloaded weights is SIGKILLed at some point (mid-forward, mid-backward, mid-step, mid-save);
a new process builds the model on meta, offloads it from the same offload_dir, builds the optimizer, load()s its
last checkpoint and trains on: its final weights equal an uninterrupted run's, bit for bit."""
import signal

import pytest
import torch

from helpers.fork import fork_server, forkserver, run_child  # noqa: F401
from helpers.offload_train_crash_child import train

pytestmark = pytest.mark.crash



def _run(forkserver, tmp_path, name, od, resume=False, kill=None, dtype="float32", in_backward=False, offload="nvme"):
    """Runs the child; (its exit code, the path of its final weights)."""
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    out = tmp_path / f"{name}.pt"
    code = run_child(forkserver, train, str(od), str(tmp_path / "ckpt"), str(swap), str(out), resume, kill, dtype,
                     in_backward, offload, timeout=300)
    return code, out


# the n-th call, counted from the start of the process (disk_offload's commit is the first commit): each lands
# after the first save (step SAVE_AT)
KILLS = [
    "swapio.offload.streamer.WeightStreamer.enter:11",        # mid-forward of step 4 (3 modules a forward)
    "swapio.offload.training.Training._arrived:16",           # mid-backward of step 3 (6 gradients a backward)
    "swapio.offload.weight_store.DiskStore.begin:8",          # mid-step of step 3, between modules
    "swapio.offload.weight_store.DiskStore.end:9",            # step 3's last weight write
    "swapio.safetensors.commit.PendingFile.commit:3",          # the save after step 4, written, not committed
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """{in_backward: final weights of a run never killed} (fp32 weights accumulating, bf16 in backward)."""
    out = {}
    for in_backward in (False, True):
        tmp = tmp_path_factory.mktemp("whole")
        code, path = _run(fork_server(), tmp, "whole", tmp / "od", dtype="bfloat16" if in_backward else "float32",
                          in_backward=in_backward)
        assert code == 0
        out[in_backward] = torch.load(path)
    return out


@pytest.mark.parametrize("in_backward", [False, True], ids=["accumulate", "in_backward"])
@pytest.mark.parametrize("kill", KILLS, ids=[k.split(".")[-1] for k in KILLS])
def test_sigkill_then_a_new_process_resumes_bit_identically(tmp_path, forkserver, uninterrupted, kill, in_backward):
    dtype = "bfloat16" if in_backward else "float32"
    od = tmp_path / "od"
    code, _ = _run(forkserver, tmp_path, "killed", od, kill=kill, dtype=dtype, in_backward=in_backward)
    assert code == -signal.SIGKILL
    code, got_path = _run(forkserver, tmp_path, "resumed", od, resume=True, dtype=dtype, in_backward=in_backward)
    assert code == 0
    want, got = uninterrupted[in_backward], torch.load(got_path)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
