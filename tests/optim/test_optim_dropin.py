"""Drop-in behaviour against torch.optim.AdamW: copies and pickles are refused clearly (never a half-object),
betas are validated like torch, old state dicts get torch's historical group defaults, parameters edited outside
the optimizer are adopted into the fp32 master (bf16, fp16, non-contiguous). DTensor parameters (FSDP2):
tests/integrations/test_framework_distributed.py (a real DTensor needs a process group)."""
import copy
import pickle
import warnings

import pytest
import torch

import swapio
import swapio.optim as so
from helpers.optim import one_thread  # noqa: F401

MODES = ["cpu", "nvme"]


def _opt(params, mode, tmp_path, **kwargs):
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    return so.OffloadAdamW(params, lr=1e-2, offload=mode, **extra, **kwargs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", [copy.deepcopy, copy.copy, pickle.dumps])
def test_copy_and_pickle_raise_type_error_pointing_at_state_dict(mode, how, tmp_path):
    p = torch.randn(10, requires_grad=True)
    with _opt([p], mode, tmp_path) as opt:
        p.grad = torch.ones(10)
        opt.step()
        with pytest.raises(TypeError, match="state_dict"):
            how(opt)
        p.grad = torch.ones(10)
        opt.step()  # the optimizer is untouched


@pytest.mark.parametrize("betas", [(0.9, torch.tensor(0.99)), (torch.tensor(0.9), 0.99)])
def test_mixed_float_and_tensor_betas_rejected_like_torch(betas):
    with pytest.raises(ValueError, match="both floats or both Tensors") as torch_error:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], betas=betas)
    with pytest.raises(ValueError, match=str(torch_error.value)):
        so.OffloadAdamW([torch.zeros(1, requires_grad=True)], betas=betas)


def test_tensor_betas_accepted_like_torch():
    so.OffloadAdamW([torch.zeros(1, requires_grad=True)], betas=(torch.tensor(0.9), torch.tensor(0.99))).close()


@pytest.mark.parametrize("missing", ["maximize", "amsgrad", "foreach", "decoupled_weight_decay"])
@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_old_state_dict_without_a_group_key_gets_torchs_historical_default(cls, missing):
    p = torch.randn(5, requires_grad=True)
    src = getattr(torch.optim, cls)([p])
    p.grad = torch.ones(5)
    src.step()
    sd = src.state_dict()
    for g in sd["param_groups"]:
        g.pop(missing, None)
    kwargs = {"maximize": True}  # a constructor argument that must not leak into the loaded group
    theirs = getattr(torch.optim, cls)([p], **kwargs)
    theirs.load_state_dict(copy.deepcopy(sd))
    ours = getattr(so, "Offload" + cls)([p], **kwargs)
    ours.load_state_dict(copy.deepcopy(sd))
    for key in ("maximize", "amsgrad", "decoupled_weight_decay"):
        assert ours.param_groups[0][key] == theirs.param_groups[0][key], key


@pytest.mark.parametrize("cls, key", [("OffloadAdamW", "lr"), ("OffloadAdamW", "betas"), ("OffloadAdam", "eps"),
                                      ("OffloadAdam", "weight_decay"), ("OffloadLion", "lr"),
                                      ("OffloadLion", "betas"), ("OffloadAdafactor", "lr"),
                                      ("OffloadAdafactor", "beta2_decay"), ("OffloadAdafactor", "d")])
def test_a_state_dict_group_without_a_hyperparameter_is_refused_not_filled_from_the_constructor(cls, key):
    """torch fills only the flags older versions lacked; a group without its lr is damaged, and torch's own
    optimizer fails at its next step. Ours refuses the load, the optimizer as it was."""
    p = torch.randn(4, 6, requires_grad=True)
    src = getattr(so, cls)([p], lr=1e-2)
    p.grad = torch.ones(4, 6)
    src.step()
    sd = src.state_dict()
    del sd["param_groups"][0][key]
    ours = getattr(so, cls)([p], lr=5.0)
    before = {k: v for k, v in ours.param_groups[0].items() if k != "params"}
    with pytest.raises(ValueError, match=rf"param group 0: .*lacks \['{key}'\]"):
        ours.load_state_dict(sd)
    assert {k: v for k, v in ours.param_groups[0].items() if k != "params"} == before
    assert ours.param_groups[0]["params"][0] is p and not ours.state


def _edit_cases():
    yield "bf16", lambda: torch.randn(64, dtype=torch.bfloat16)
    yield "fp16", lambda: torch.randn(64, dtype=torch.float16)
    yield "noncontig", lambda: torch.randn(16, 8).t()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind, make", list(_edit_cases()), ids=[k for k, _ in _edit_cases()])
def test_parameter_edited_outside_is_adopted_with_one_warning(mode, kind, make, tmp_path):
    torch.manual_seed(0)
    p = make().requires_grad_(True)
    with _opt([p], mode, tmp_path) as opt:
        p.grad = torch.randn_like(p)
        opt.step()
        with torch.no_grad():
            p[:2].fill_(1.5)   # what model.load_state_dict, clamping or EMA copy-back do: an in-place write
        edited = p.detach().clone()
        with pytest.warns(swapio.SwapioWarning, match="adopted"):
            p.grad = torch.zeros_like(p)
            opt.step()
        # one step moves an element by about lr (1e-2): the edited values survive, not the old master's
        assert (p.detach().float()[:2] - 1.5).abs().max() < 0.05
        master = opt.state_dict()["state"][0].get("master")
        if master is not None:
            assert (master.reshape(p.shape)[:2] - 1.5).abs().max() < 0.01
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing edited since: no warning, nothing adopted
            p.grad = torch.randn_like(p)
            opt.step()


@pytest.mark.parametrize("mode", MODES)
def test_unedited_parameters_keep_their_fp32_master(mode, tmp_path):
    p = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    with _opt([p], mode, tmp_path) as opt:
        for _ in range(3):
            p.grad = torch.randn_like(p)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                opt.step()
        master = opt.state_dict()["state"][0]["master"]
        assert not torch.equal(master, master.to(torch.bfloat16).float())  # finer than bf16: never overwritten


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", [so.OffloadAdamW, so.OffloadLion, so.OffloadAdafactor], ids=lambda c: c.__name__)
def test_a_backward_through_weights_stepped_since_raises_as_with_torch(cls, dtype, mode, tmp_path):
    """A graph built before step() (a loss computed, then a discriminator's step, then its backward): torch's step
    bumps each parameter's version counter, so autograd refuses the saved, since-overwritten weights. The kernel
    writing the parameters in place bumped nothing, and the backward silently used the new weights."""
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    w = torch.randn(4, 8).to(dtype).requires_grad_(True)
    with cls([w], lr=1e-2, offload=mode, **extra) as opt:
        for _ in range(2):  # the first step and a later one
            loss = (w * w).sum()  # saves w
            w.grad = torch.randn_like(w)
            version = w._version
            opt.step()
            assert w._version > version
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # its own writes are not taken for outside edits
            w.grad = torch.randn_like(w)
            opt.step()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_a_model_cast_to_bf16_after_its_first_step_is_refused_naming_the_dtype(mode, tmp_path):
    """model.to(torch.bfloat16) after a step: an fp32 parameter (its own master) now needs a master its state
    lacks. cpu mode blamed amsgrad or the number of dimensions; the error names the dtype change now."""
    model = torch.nn.Linear(4, 4)
    extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
    opt = so.OffloadAdamW(model.parameters(), offload=mode, **extra)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    model.to(torch.bfloat16)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(RuntimeError, match=r"(?s)changed.*dtype|dtype.*changed"):
        opt.step()
    opt.close()
