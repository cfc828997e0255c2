"""A process training offloaded weights is SIGKILLed at some point (mid-forward, mid-backward, mid-step, mid-save);
a new process builds the model on meta, offloads it from the same offload_dir, builds the optimizer, load()s its
last checkpoint and trains on: its final weights equal an uninterrupted run's, bit for bit."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.crash

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, SAVE_AT = 4, 2

CHILD = textwrap.dedent('''
    import os, signal, sys, torch
    sys.path.insert(0, {repo!r})
    from swapio.offload import disk_offload, remove_offload
    from swapio.optim import OffloadAdamW
    torch.set_num_threads(1)
    od, ckpt, swap, out, resume, kill, dtype, in_backward, offload = sys.argv[1:10]
    dtype, in_backward, resume = getattr(torch, dtype), in_backward == "1", resume == "1"

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                   torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(dtype)

    if kill != "none":  # SIGKILL at the n-th call of module.Class.method
        import importlib
        where, n = kill.rsplit(":", 1)
        module, cls, method = where.rsplit(".", 2)
        owner = getattr(importlib.import_module(module), cls)
        inner, calls = getattr(owner, method), [0]
        def wrapper(*a, **k):
            calls[0] += 1
            if calls[0] == int(n):
                os.kill(os.getpid(), signal.SIGKILL)
            return inner(*a, **k)
        setattr(owner, method, wrapper)

    if resume:
        with torch.device("meta"):
            model = make()
    else:
        model = make()
    disk_offload(model, offload_dir=od)
    opt = OffloadAdamW(model.parameters(), lr=1e-2, offload=offload, swap_dir=swap, in_backward=in_backward)
    start = 0
    if resume:
        opt.load(ckpt)
        start = int(next(iter(opt.state.values()))["step"])
    for i in range(start, {steps}):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 32, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)
        loss = (model(x) - y).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i + 1 >= {save_at}:
            opt.save(ckpt)
    remove_offload(model)
    torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, out)
''').format(repo=REPO, steps=STEPS, save_at=SAVE_AT)


def _run(tmp_path, name, od, resume=False, kill="none", dtype="float32", in_backward=False, offload="nvme"):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run([sys.executable, str(script), str(od), str(tmp_path / "ckpt"), str(swap), str(out),
                           "1" if resume else "0", kill, dtype, "1" if in_backward else "0", offload],
                          capture_output=True, text=True, timeout=300)
    return proc, out


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
        proc, path = _run(tmp, "whole", tmp / "od", dtype="bfloat16" if in_backward else "float32",
                          in_backward=in_backward)
        assert proc.returncode == 0, proc.stderr
        out[in_backward] = torch.load(path)
    return out


@pytest.mark.parametrize("in_backward", [False, True], ids=["accumulate", "in_backward"])
@pytest.mark.parametrize("kill", KILLS, ids=[k.split(".")[-1] for k in KILLS])
def test_sigkill_then_a_new_process_resumes_bit_identically(tmp_path, uninterrupted, kill, in_backward):
    dtype = "bfloat16" if in_backward else "float32"
    od = tmp_path / "od"
    proc, _ = _run(tmp_path, "killed", od, kill=kill, dtype=dtype, in_backward=in_backward)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    proc, got_path = _run(tmp_path, "resumed", od, resume=True, dtype=dtype, in_backward=in_backward)
    assert proc.returncode == 0, proc.stderr
    want, got = uninterrupted[in_backward], torch.load(got_path)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
