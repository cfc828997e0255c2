"""zero_grad() without step() after a backward whose updates in_backward=True had already applied: a step skipped
after backward (a non-finite loss found then), or another loss's backward that reached the parameters (a GAN's
generator loss through its discriminator, whose own optimizer then calls zero_grad()). torch would discard those
gradients; the updates ran and stay (docs/offload.md, decided), which went unsaid. Now a SwapioWarning says so,
once per optimizer; the usual loops and the recovery from a backward that raised (zero_grad() after the catch, as
the docs say) warn nothing. GPU parameters on the simulated CUDA layer of test_optim_gpu_pipeline_simulated, and
offloaded weights."""
import warnings

import pytest
import torch

import swapio
from swapio.core._errors import SwapioWarning
from swapio.offload import remove_offload
from helpers.autograd import OnBackward
from helpers.offload_training import MLP, batches, build_opt, loss_of, make_model, offload, one_thread
from test_optim_gpu_pipeline_simulated import _loss, _model, fake_gpu  # noqa: F401 - the simulated GPU fixture


def _fail():
    raise RuntimeError("simulated failure in backward")


def _gpu_setup(fake_gpu):
    gpu, _, _, _ = fake_gpu
    model = _model(torch.float32)
    gpu.update(p.detach() for p in model.parameters())
    opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2, offload="cpu", in_backward=True)
    first, _, last = model

    def failing(i):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i))
        return last(torch.tanh(OnBackward.apply(first(x), _fail))).square().mean()
    return lambda i: _loss(model, i), failing, opt, lambda: None


def _offloaded_setup(tmp_path):
    model = offload(make_model(), "cpu", tmp_path)
    opt = build_opt("AdamW", model.parameters(), tmp_path / "s", offload="cpu", in_backward=True)
    data = batches(MLP, 8)

    def failing(i):
        x, y = data[i]
        h = torch.tanh(OnBackward.apply(model.a(x), _fail))
        return torch.nn.functional.mse_loss(model.c(torch.tanh(model.b(model.norm(h)))), y)
    return lambda i: loss_of(model, data[i]), failing, opt, lambda: remove_offload(model)


@pytest.fixture(params=["gpu", "offloaded"])
def setup(request, tmp_path):
    if request.param == "gpu":
        return _gpu_setup(request.getfixturevalue("fake_gpu"))
    return _offloaded_setup(tmp_path)


def test_a_backward_no_step_followed_warns_at_zero_grad_once(setup):
    loss, failing, opt, done = setup
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("error", SwapioWarning)
        for i in range(2):  # the usual loops warn nothing
            opt.zero_grad()
            loss(i).backward()
            opt.step()
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="simulated failure"):
            failing(2).backward()
        opt.zero_grad()  # the recovery the docs name
        loss(3).backward()  # a stray backward (another loss reaching the parameters), no step()
        with pytest.warns(SwapioWarning, match=r"(?s)zero_grad\(\) without step\(\).*in_backward=False"):
            opt.zero_grad()
        loss(4).backward()
        opt.zero_grad()  # once per optimizer
        loss(5).backward()
        opt.step()
    opt.close()
    done()
