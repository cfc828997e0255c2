"""OffloadAdafactor driven the way torch.optim.Adafactor users drive it, each against torch.optim.Adafactor in both
offload modes: tiny and odd shapes (0-d, 1 x n, n x 1, size-1 batches, a tail past a 4096 block), gradients
missing on some steps, fp16 parameters, a tensor lr under LambdaLR, hyperparameters edited in param_groups between
steps, clip_grad_norm_, zero_grad(set_to_none=False) and add_param_group in the middle of a run."""
import pytest
import torch

so = pytest.importorskip("swapio.optim", reason="swapio is not built (python setup.py build_ext --inplace)")
from helpers.optim import SMALL_BUFFERS, feed, masters, one_thread, rel_diff  # noqa: E402,F401

ODD_SHAPES = [(), (1,), (1, 1), (1, 7), (7, 1), (2, 1, 1), (1, 1, 5), (65, 3), (4097,)]


def pair(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ours = [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]
    return ours, [p.detach().float().clone().requires_grad_(True) for p in ours]


def build(params, offload, tmp_path, **kw):
    return so.OffloadAdafactor(params, offload=offload, swap_dir=tmp_path, **SMALL_BUFFERS, **kw)


def assert_same_as_torch(ours, ours_params, ref, ref_params):
    for mine, theirs in zip(masters(ours, ours_params), ref_params):
        assert rel_diff(mine, theirs) < 1e-5
    state = ours.state_dict()["state"]
    for i, p in enumerate(ref_params):
        assert (i in state) == (p in ref.state), i
        for name, value in ref.state.get(p, {}).items():
            assert state[i][name].shape == value.shape, (i, name)
            torch.testing.assert_close(state[i][name], value, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_odd_shapes_with_gradients_missing_on_some_steps_match_torch(offload, dtype, tmp_path):
    ours_params, ref_params = pair(ODD_SHAPES, dtype)
    ours = build(ours_params, offload, tmp_path, weight_decay=0.05)
    ref = torch.optim.Adafactor(ref_params, weight_decay=0.05)
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = [torch.randn(p.shape, generator=gen) for p in ours_params]
        feed(ours_params, ref_params, [None if (step + i) % 3 == 0 or (i == 4 and step < 6) else g
                                       for i, g in enumerate(grads)])
        ours.step()
        ref.step()
    assert_same_as_torch(ours, ours_params, ref, ref_params)
    ours.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_tensor_lr_under_lambda_lr_and_hyperparameters_edited_between_steps_match_torch(offload, tmp_path):
    ours_params, ref_params = pair([(9,), (6, 10), (2, 3, 4)])
    ours = build(ours_params, offload, tmp_path, lr=torch.tensor(0.05))
    ref = torch.optim.Adafactor(ref_params, lr=torch.tensor(0.05))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e)) for o in (ours, ref)]
    edits = [("eps", (1e-6, 1e-2)), ("d", 1.3), ("beta2_decay", -0.5), ("weight_decay", 0.2), ("maximize", True),
             ("eps", [None, 0.0])]
    gen = torch.Generator().manual_seed(2)
    for step in range(12):
        if step % 2 == 0 and edits:
            key, value = edits.pop(0)
            ours.param_groups[0][key] = ref.param_groups[0][key] = value
        feed(ours_params, ref_params, [torch.randn(p.shape, generator=gen) for p in ours_params])
        ours.step()
        ref.step()
        for s in scheds:
            s.step()
    assert float(ours.param_groups[0]["lr"]) == float(ref.param_groups[0]["lr"])
    assert_same_as_torch(ours, ours_params, ref, ref_params)
    ours.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_clip_grad_norm_zeroed_gradients_and_a_group_added_mid_run_match_torch(offload, tmp_path):
    ours_params, ref_params = pair([(9,), (6, 10), (5, 7), (11,)])
    ours = build(ours_params[:2], offload, tmp_path)
    ref = torch.optim.Adafactor(ref_params[:2])
    gen = torch.Generator().manual_seed(3)
    n = 2
    for step in range(10):
        if step == 4:
            group = {"lr": 0.03, "weight_decay": 0.1, "maximize": True, "eps": (1e-5, 1e-2), "d": 2.0}
            ours.add_param_group({"params": ours_params[2:], **group})
            ref.add_param_group({"params": ref_params[2:], **group})
            n = 4
        feed(ours_params[:n], ref_params[:n], [torch.randn(p.shape, generator=gen) for p in ours_params[:n]])
        for params in (ours_params[:n], ref_params[:n]):
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        ours.step()
        ref.step()
        ours.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
        if step % 3 == 0:  # zero gradients (not None): torch steps them, counting the step
            ours.step()
            ref.step()
    assert_same_as_torch(ours, ours_params, ref, ref_params)
    ours.close()


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_transformers_eps_on_an_embedding_with_unused_tokens_goes_as_torch(offload, tmp_path):
    """eps=(1e-30, 1e-3), transformers.Adafactor's default, kept by a user moving to torch's API: torch clamps the
    second moment with 1e-30 ** 2, 0 in float32, so the rows of tokens missing from the first batch become NaN.
    Ours did not (the kernel clamped the square roots with 1e-30 itself): a switch to or from torch mid-run changed
    the numbers. The same NaN rows, the same finite rest."""
    ours_params, ref_params = pair([(10, 6)])
    ours = build(ours_params, offload, tmp_path, eps=(1e-30, 1e-3))
    ref = torch.optim.Adafactor(ref_params, eps=(1e-30, 1e-3))
    grad = torch.randn(10, 6, generator=torch.Generator().manual_seed(4))
    grad[[2, 7]] = 0.0  # tokens 2 and 7 not in the batch
    feed(ours_params, ref_params, [grad])
    ours.step()
    ref.step()
    mine, theirs = ours_params[0].detach(), ref_params[0].detach()
    assert torch.isnan(theirs[[2, 7]]).all()
    assert torch.equal(torch.isnan(mine), torch.isnan(theirs))
    finite = ~torch.isnan(theirs)
    torch.testing.assert_close(mine[finite], theirs[finite], rtol=1e-5, atol=1e-6)
    ours.close()
