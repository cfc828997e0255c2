"""Tensor hyperparameters, as torch.optim.Adam/AdamW take them (lr=torch.tensor(1e-3), betas=(torch.tensor(0.9),
torch.tensor(0.999))): the param groups keep the user's tensors and every step reads them, so an in-place change
(a scheduler's group["lr"].fill_(x), the user's own betas[0].fill_(...)) is followed as torch follows it, step by
step against torch. The betas were kept as the floats they held at construction: a later edit of the tensors was
ignored, silently."""
import pytest
import torch

import swapio.optim as so
from helpers.optim import one_thread  # noqa: F401

MODES = ["cpu", "nvme"]
PAIRS = [(so.OffloadAdam, torch.optim.Adam), (so.OffloadAdamW, torch.optim.AdamW)]


def _hyper():
    return torch.tensor(1e-2), (torch.tensor(0.9), torch.tensor(0.999))


def _pair(ours_type, torch_type, mode, tmp_path, n=300):
    torch.manual_seed(0)
    start = torch.randn(n)
    ours_p, theirs_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours_lr, ours_betas = _hyper()
    theirs_lr, theirs_betas = _hyper()
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    ours = ours_type([ours_p], lr=ours_lr, betas=ours_betas, offload=mode, **extra)
    theirs = torch_type([theirs_p], lr=theirs_lr, betas=theirs_betas, foreach=False)
    return (ours_p, ours_lr, ours_betas, ours), (theirs_p, theirs_lr, theirs_betas, theirs)


def _step_both(ours, theirs, seed):
    grad = torch.randn(ours[0].shape, generator=torch.Generator().manual_seed(seed))
    for p, _, _, opt in (ours, theirs):
        p.grad = grad.clone()
        opt.step()
    torch.testing.assert_close(ours[0].detach(), theirs[0].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ours_type, torch_type", PAIRS, ids=["Adam", "AdamW"])
def test_in_place_edits_of_tensor_hyperparameters_are_followed_like_torch(ours_type, torch_type, mode, tmp_path):
    ours, theirs = _pair(ours_type, torch_type, mode, tmp_path)
    group = ours[3].param_groups[0]
    assert group["lr"] is ours[1] and group["betas"][0] is ours[2][0] and group["betas"][1] is ours[2][1]
    try:
        _step_both(ours, theirs, 0)
        for side in (ours, theirs):
            side[1].fill_(5e-2)  # the user's own lr tensor
        _step_both(ours, theirs, 1)
        for side in (ours, theirs):
            side[2][0].fill_(0.5)  # the user's own betas tensors
            side[2][1].fill_(0.99)
        _step_both(ours, theirs, 2)
        for side in (ours, theirs):
            side[3].param_groups[0]["betas"][0].fill_(0.8)  # through the group
        _step_both(ours, theirs, 3)
        # a scheduler changes a tensor lr in place (torch's LRScheduler fills it)
        schedulers = [torch.optim.lr_scheduler.StepLR(side[3], 1, gamma=0.5) for side in (ours, theirs)]
        for seed in (4, 5, 6):
            _step_both(ours, theirs, seed)
            for s in schedulers:
                s.step()
        assert group["lr"] is ours[1] and float(ours[1]) == float(theirs[1]) == pytest.approx(5e-2 / 8)
    finally:
        ours[3].close()


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_round_trip_keeps_tensor_hyperparameters_followed(mode, tmp_path):
    """swapio's state_dict() carries the tensors as torch's does; either side loads the other's, and the loaded
    group's tensors are then the ones a scheduler edits in place."""
    ours, theirs = _pair(so.OffloadAdamW, torch.optim.AdamW, mode, tmp_path)
    try:
        ours[2][0].fill_(0.7)
        theirs[2][0].fill_(0.7)
        _step_both(ours, theirs, 0)
        sd = ours[3].state_dict()
        theirs_betas = theirs[3].param_groups[0]["betas"]
        assert [float(b) for b in sd["param_groups"][0]["betas"]] == [float(b) for b in theirs_betas]
        other_p = torch.nn.Parameter(ours[0].detach().clone())
        extra = {"swap_dir": tmp_path / "other"} if mode == "nvme" else {}
        with so.OffloadAdamW([other_p], lr=0.5, betas=(0.1, 0.2), offload=mode, **extra) as other:
            other.load_state_dict(theirs[3].state_dict())  # torch's tensors
            other.param_groups[0]["lr"].fill_(3e-2)
            other.param_groups[0]["betas"][1].fill_(0.95)
            theirs[3].param_groups[0]["lr"].fill_(3e-2)
            theirs[3].param_groups[0]["betas"][1].fill_(0.95)
            _step_both((other_p, None, None, other), theirs, 1)
    finally:
        ours[3].close()


@pytest.mark.parametrize("mode", MODES)
def test_save_and_load_with_tensor_hyperparameters_resume_like_the_run(mode, tmp_path):
    ours, theirs = _pair(so.OffloadAdamW, torch.optim.AdamW, mode, tmp_path)
    try:
        ours[2][0].fill_(0.6)
        theirs[2][0].fill_(0.6)
        _step_both(ours, theirs, 0)
        ours[3].save(tmp_path / "ckpt")
        p = torch.nn.Parameter(ours[0].detach().clone())
        extra = {"swap_dir": tmp_path / "other"} if mode == "nvme" else {}
        with so.OffloadAdamW([p], lr=0.5, offload=mode, **extra) as resumed:
            resumed.load(tmp_path / "ckpt")
            assert float(resumed.param_groups[0]["betas"][0]) == pytest.approx(0.6)
            _step_both((p, None, None, resumed), theirs, 1)
    finally:
        ours[3].close()


def test_lion_follows_its_tensor_betas():
    """OffloadLion (no torch counterpart) with tensor betas edited in place steps as one given those numbers."""
    torch.manual_seed(0)
    start, grads = torch.randn(300), [torch.randn(300) for _ in range(3)]
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    betas = (torch.tensor(0.9), torch.tensor(0.99))
    with so.OffloadLion([a], lr=1e-2, betas=betas) as tensors, \
            so.OffloadLion([b], lr=1e-2, betas=(0.9, 0.99)) as floats:
        for i, g in enumerate(grads):
            if i == 1:
                betas[0].fill_(0.5)
                floats.param_groups[0]["betas"] = (float(betas[0]), float(betas[1]))
            a.grad, b.grad = g.clone(), g.clone()
            tensors.step()
            floats.step()
            assert torch.equal(a, b), i


def test_one_element_tensor_betas_are_kept_as_views_like_torch():
    beta1, beta2 = torch.tensor([0.9]), torch.tensor([0.999])
    with so.OffloadAdamW([torch.nn.Parameter(torch.zeros(3))], betas=(beta1, beta2)) as opt:
        kept = opt.param_groups[0]["betas"]
        assert kept[0].dim() == 0 and kept[0].data_ptr() == beta1.data_ptr()
        beta1.fill_(0.5)
        assert float(kept[0]) == 0.5
