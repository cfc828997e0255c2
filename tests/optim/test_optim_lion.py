"""swapio.optim.OffloadLion against Lion written in plain torch (the paper's pseudocode), in both offload modes."""
import pytest
import torch

optim = pytest.importorskip("swapio.optim", reason="swapio is not built (python setup.py build_ext --inplace)")


def lion_reference(params, grads, states, *, lr, beta1, beta2, weight_decay):
    """One step of Lion in plain torch: p *= 1 - lr*wd; p -= lr * sign(beta1*m + (1-beta1)*g); m = lerp."""
    for p, g, m in zip(params, grads, states):
        p.mul_(1 - lr * weight_decay)
        p.add_(m.mul(beta1).add_(g, alpha=1 - beta1).sign_(), alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1 - beta2)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_twenty_steps_match_plain_torch_lion(offload, tmp_path):
    net, ref = model(), model()
    hyper = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    opt = optim.OffloadLion(net.parameters(), offload=offload, swap_dir=tmp_path, **hyper)
    states = [torch.zeros_like(p) for p in ref.parameters()]
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(20):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        for m in (net, ref):
            m.zero_grad()
            loss = (m(x) - y).square().mean()
            loss.backward()
        losses.append(loss.item())
        opt.step()
        with torch.no_grad():
            lion_reference(list(ref.parameters()), [p.grad for p in ref.parameters()], states, lr=3e-3, beta1=0.9,
                           beta2=0.99, weight_decay=0.1)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    exported = opt.state_dict()["state"]
    for i, m in enumerate(states):
        torch.testing.assert_close(exported[i]["exp_avg"], m, rtol=1e-6, atol=1e-8)
    assert losses[-1] < losses[0]
    opt.close()


def test_defaults_are_the_papers_and_bad_hyperparameters_raise_at_construction():
    net = model()
    opt = optim.OffloadLion(net.parameters())
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["weight_decay"]) == (1e-4, (0.9, 0.99), 0.0)
    for bad in (dict(lr=-1.0), dict(betas=(1.5, 0.99)), dict(betas=(0.9, -0.1)), dict(weight_decay=-0.1),
                dict(betas=0.9), dict(offload="disk")):
        with pytest.raises(ValueError):
            optim.OffloadLion(net.parameters(), **bad)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_save_load_resumes_bit_identically(offload, tmp_path):
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 32, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(6)]

    def train(net, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            (net(x) - y).square().mean().backward()
            opt.step()

    a = model()
    opt_a = optim.OffloadLion(a.parameters(), lr=1e-3, weight_decay=0.05, offload=offload, swap_dir=tmp_path)
    train(a, opt_a, data[:3])
    opt_a.save(tmp_path / "ckpt")
    b = model()
    b.load_state_dict(a.state_dict())
    opt_b = optim.OffloadLion(b.parameters(), lr=1e-3, weight_decay=0.05, offload=offload, swap_dir=tmp_path)
    opt_b.load(tmp_path / "ckpt")
    train(a, opt_a, data[3:])
    train(b, opt_b, data[3:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    opt_a.close()
    opt_b.close()


def test_loss_falls_on_a_small_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    net = transformers.GPT2LMHeadModel(cfg)
    text = (b"the quick brown fox jumps over the lazy dog. " * 40)
    ids = torch.tensor(list(text[:33 * 8]), dtype=torch.long).view(8, 33)
    opt = optim.OffloadLion(net.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = net(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
