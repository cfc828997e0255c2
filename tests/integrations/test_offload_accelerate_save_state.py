"""accelerate's save_state() of a model offloaded by swapio: its state_dict() holds placeholders, not the weights,
so the save fails with a RuntimeError naming the weight and what saves it instead (save_checkpoint, opt.save),
not torch's "Cannot copy out of meta tensor" (safetensors) or a silent file of meta tensors (pickle). What the
message recommends works: the weights saved by save_checkpoint and the state by opt.save resume the run."""
import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

import swapio.optim as so  # noqa: E402
from swapio.offload import cpu_offload, disk_offload, remove_offload, save_checkpoint  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


OFFLOADS = {"disk": lambda net, tmp: disk_offload(net, offload_dir=tmp / "od"), "cpu": lambda net, tmp: cpu_offload(net)}


def _prepared(kind, tmp_path):
    accelerator = Accelerator(cpu=True)
    net = OFFLOADS[kind](_net(), tmp_path)
    opt = so.OffloadAdamW(net.parameters(), lr=1e-2, offload="cpu")
    net, opt = accelerator.prepare(net, opt)
    accelerator.backward(net(torch.randn(4, 8)).square().mean())
    opt.step()
    opt.zero_grad()
    return accelerator, net, opt


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_save_state_of_an_offloaded_model_names_what_saves_it(kind, safe, tmp_path):
    accelerator, net, opt = _prepared(kind, tmp_path)
    with pytest.raises(RuntimeError, match=r"0\.weight is offloaded by swapio(.|\n)*save_checkpoint(.|\n)*opt\.save"):
        accelerator.save_state(str(tmp_path / "state"), safe_serialization=safe)
    # what the message says to use instead works: opt.save, then load() into a new run, offloaded weights included
    opt.optimizer.save(str(tmp_path / "opt"))
    save_checkpoint(net, str(tmp_path / "weights.safetensors"))
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = net(x)
    opt.optimizer.close()
    remove_offload(net)

    again = OFFLOADS[kind](_net(), tmp_path / "again")
    opt = so.OffloadAdamW(again.parameters(), lr=1e-2, offload="cpu")
    opt.load(str(tmp_path / "opt"))
    with torch.no_grad():
        torch.testing.assert_close(again(x), out, rtol=0, atol=0)
    opt.close()
    remove_offload(again)


@pytest.mark.parametrize("kind", list(OFFLOADS))
def test_save_state_with_the_offloaded_model_left_out_of_prepare_resumes_exactly(kind, tmp_path):
    """The other way the message names: prepare the optimizer and scheduler (not the offloaded model), and
    save_state / load_state resume bit-identically, since the optimizer's load_state_dict rewrites the offloaded
    weights from its fp32 masters (a new model with other initial weights ends where the first run ends)."""
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def run(seed, directory, load=None, save=None):
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(seed)
        net = OFFLOADS[kind](torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)),
                             directory)
        opt = so.OffloadAdamW(net.parameters(), lr=1e-2, offload="cpu")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        opt, sched = accelerator.prepare(opt, sched)
        if load:
            accelerator.load_state(load)
        for i, x in enumerate(batches[3:] if load else batches):
            if save and i == 3:
                accelerator.save_state(save)
            accelerator.backward(net(x).square().mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        with torch.no_grad():
            out = net(torch.ones(2, 8))
        opt.optimizer.close()
        remove_offload(net)
        return out

    state = str(tmp_path / "state")
    full = run(0, tmp_path / "a", save=state)
    torch.testing.assert_close(run(1, tmp_path / "b", load=state), full, rtol=0, atol=0)
