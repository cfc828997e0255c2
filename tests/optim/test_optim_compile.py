"""torch.compile around an offloaded optimizer's step (PyTorch's "compiled optimizer" habit): the step runs eagerly,
outside the graphs, with the numbers of the eager step; fullgraph=True fails saying why."""

import pytest
import torch

import swapio.optim as so


def model_and_opt(cls, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    return model, getattr(so, cls)(model.parameters(), lr=1e-2, **kw)


def loss_of(model, i):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
    return model(x).square().mean()


def recording_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend


@pytest.mark.parametrize("cls, kw", [("OffloadAdamW", {}), ("OffloadAdamW", {"state_dtype": "int8"}),
                                     ("OffloadLion", {}), ("OffloadAdafactor", {})])
def test_a_compiled_step_runs_eagerly_with_the_eager_numbers(cls, kw):
    torch._dynamo.reset()
    model, opt = model_and_opt(cls, **kw)
    twin, ref = model_and_opt(cls, **kw)
    graphs = []
    step = torch.compile(opt.step, backend=recording_backend(graphs))
    with opt, ref:
        for i in range(12):  # past dynamo's recompile limit (8), which the step count's changes used to hit
            loss_of(model, i).backward()
            step()
            opt.zero_grad()
            loss_of(twin, i).backward()
            ref.step()
            ref.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert graphs == []  # nothing of the step was traced into a graph


def test_a_compiled_training_step_calling_the_optimizer_matches_eager():
    torch._dynamo.reset()
    model, opt = model_and_opt("OffloadAdamW")
    twin, ref = model_and_opt("OffloadAdamW")

    @torch.compile(backend="eager")
    def train_step(i):
        loss = loss_of(model, i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with opt, ref:
        for i in range(4):
            ours = train_step(i)
            theirs = loss_of(twin, i)
            theirs.backward()
            ref.step()
            ref.zero_grad()
            assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_fullgraph_says_the_step_runs_eagerly():
    torch._dynamo.reset()
    model, opt = model_and_opt("OffloadAdamW")
    with opt:
        loss_of(model, 0).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(Exception, match="offloaded optimizer's step runs eagerly"):
            torch.compile(opt.step, backend="eager", fullgraph=True)()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
        opt.step()  # and the optimizer goes on
        assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))



ORDER_CHILD = """
import sys, torch, swapio.optim as so
from swapio.offload import compiled, cpu_offload
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
twin.load_state_dict(model.state_dict())
x = torch.randn(4, 8)
want = twin(x)
model = cpu_offload(model)
assert torch.equal(model(x), want)
assert "torch._dynamo" not in sys.modules, "offloading imported dynamo (a second) without torch.compile"
assert not compiled._done
opt = so.OffloadAdamW(twin.parameters(), lr=1e-2)
assert compiled._done  # torch's Optimizer imports dynamo, which marks the boundaries as it loads
assert torch.equal(torch.compile(model, backend="eager")(x), want)  # the offloaded modules ran eagerly
print("ok")
"""


def test_the_boundaries_are_marked_as_dynamo_loads_and_it_is_not_loaded_without_compile():
    """torch._dynamo (a second to import) comes in with torch.compile or torch's Optimizer, not with an offload;
    swapio's boundaries are marked as it loads, whenever that is."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", ORDER_CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("in_backward", [False, True])
def test_a_compiled_training_step_of_an_offloaded_model_matches_eager(in_backward, clip):
    """backward() inside the compiled function runs autograd's hooks under dynamo: it traced into the hooks that
    hand an offloaded weight's gradient to the optimizer, and into opt.clip_grad_norm_, and failed on the gradient
    markers ("storage_offset() on p.grad of the offloaded weight")."""
    from swapio.offload import cpu_offload

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model, _ = model_and_opt("OffloadAdamW")
        model = cpu_offload(model)
        opt = so.OffloadAdamW(model.parameters(), lr=1e-2, in_backward=in_backward)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)

        def train_step(i):
            loss = loss_of(model, i)
            loss.backward()
            if clip and not in_backward:
                opt.clip_grad_norm_(0.1)
            opt.step()
            opt.zero_grad()
            return loss

        step = torch.compile(train_step, backend="eager") if compiled else train_step
        with opt:
            losses = []
            for i in range(4):
                losses.append(step(i))
                if not in_backward:
                    sched.step()
            runs.append((losses, [opt.param_value(p).clone() for p in model.parameters()],
                         torch.compile(opt.state_dict, backend="eager")() if compiled else opt.state_dict()))
    (eager_losses, eager_weights, eager_sd), (losses, weights, sd) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    assert all(torch.equal(a, b) for a, b in zip(weights, eager_weights))
    assert sd["param_groups"] == eager_sd["param_groups"]
    assert all(torch.equal(sd["state"][k][f], eager_sd["state"][k][f]) for k in eager_sd["state"]
               for f in eager_sd["state"][k])


@pytest.mark.parametrize("clear", ["model.zero_grad()", "model.zero_grad(set_to_none=False)", "p.grad = None"])
def test_gradients_of_offloaded_weights_cleared_the_torch_way_inside_a_compiled_step(clear):
    """dynamo reads the metadata of each p.grad it meets (storage_offset, is_conj, is_neg), which the gradient
    marker of an offloaded weight refused: the compile failed with the marker's error, which names
    model.zero_grad() as the way to drop the gradient. torch.nn.utils.clip_grad_norm_ is still refused, as eagerly."""
    from swapio.offload import cpu_offload

    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        model, _ = model_and_opt("OffloadAdamW")
        model = cpu_offload(model)
        opt = so.OffloadAdamW(model.parameters(), lr=1e-2)

        def train_step(i):
            loss_of(model, i).backward()
            opt.step()
            if clear == "p.grad = None":
                for p in model.parameters():
                    p.grad = None
            else:
                model.zero_grad(set_to_none=clear == "model.zero_grad()")

        step = torch.compile(train_step, backend="eager") if compiled else train_step
        with opt:
            for i in range(4):  # a gradient left over would be summed into the next step's
                step(i)
            runs.append([opt.param_value(p).clone() for p in model.parameters()])
            if compiled:
                loss_of(model, 5).backward()
                with pytest.raises(RuntimeError, match=r"on p.grad of the offloaded weight .*opt.clip_grad_norm_"):
                    torch.compile(torch.nn.utils.clip_grad_norm_, backend="eager")(list(model.parameters()), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
