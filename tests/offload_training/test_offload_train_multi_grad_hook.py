"""torch.autograd.graph.register_multi_grad_hook over an offloaded model's parameters. With mode="all" (the default)
torch counts how many of the tensors' gradient nodes the running backward executes, and calls the hook when that
many gradients arrived; an offloaded weight's placeholder is in no backward's graph (each forward computes with a
fresh leaf), so the count was 0 and the hook never ran, without a word (with resident parameters in the list it
ran several times per backward, each time on part of the gradients). It is now a RuntimeError at registration naming the weight and the per-weight
hooks that work; mode="any" runs as on the resident model."""
import pytest
import torch

from helpers.offload_training import MLP, batches, build_opt, loss_of, make_model, offload, one_thread

pytest.importorskip("safetensors")


@pytest.mark.parametrize("keep", [(), ("c",)], ids=["all-offloaded", "c-resident"])
@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_mode_all_is_refused_at_registration(tmp_path, storage, keep):
    model = offload(make_model(), storage, tmp_path, keep_resident=list(keep))
    with pytest.raises(RuntimeError, match=r"(?s)register_multi_grad_hook\(mode='all'\) was given a\.weight, which is "
                                           r"offloaded by swapio.*p\.register_hook\(fn\)"):
        torch.autograd.graph.register_multi_grad_hook(list(model.parameters()), lambda grads: None)


@pytest.mark.parametrize("storage", ["disk", "cpu"])
def test_mode_any_runs_as_on_resident(tmp_path, storage):
    data = batches(MLP, 2)
    seen = []
    for offloaded in (False, True):
        model = offload(make_model(), storage, tmp_path / str(offloaded)) if offloaded else make_model()
        opt = build_opt("AdamW", model.parameters(), tmp_path / f"swap{offloaded}", offload="cpu")
        calls = []
        torch.autograd.graph.register_multi_grad_hook(list(model.parameters()), lambda g: calls.append(g.clone()),
                                                      mode="any")
        with one_thread():
            for b in data:
                loss_of(model, b).backward()
                opt.step()
                opt.zero_grad()
        opt.close()
        seen.append(calls)
    assert len(seen[0]) == len(seen[1]) == len(data)
    assert all(torch.equal(a, b) for a, b in zip(*seen))
