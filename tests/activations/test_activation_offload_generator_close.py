"""A generator that yields losses from inside a `with` block of offload_activations, closed by its consumer
(gen.close(), or dropped) after taking some: the GeneratorExit ending the block counted as a failed forward and
discarded the graphs already handed out, whose backward then raised "discarded" where it runs without offload."""
import contextlib
import gc

import torch

from helpers.activations import assert_same_grads, batch, hooks_installed, make_stack, swap_files
from swapio.offload import offload_activations


def losses(model, x, ctx):
    with ctx:
        for scale in range(1, 10):
            yield model(x * scale).square().mean()


def two_steps_then_close(model, x, ctx):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    gen = losses(model, x, ctx)
    taken = [next(gen), next(gen)]
    gen.close()
    for loss in taken:
        loss.backward()
    return torch.stack(taken).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad.clone()


def test_a_generator_closed_in_the_block_leaves_its_graphs_to_their_backward(tmp_path):
    model, x = make_stack(), batch()
    model.eval()  # (no dropout: both runs draw no random numbers)
    want = two_steps_then_close(model, x, contextlib.nullcontext())
    act = offload_activations(to="nvme", swap_dir=tmp_path, model=model, min_bytes=0, staging_bytes=0)
    assert_same_grads(two_steps_then_close(model, x, act), want)
    assert not hooks_installed()
    gc.collect()
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()
