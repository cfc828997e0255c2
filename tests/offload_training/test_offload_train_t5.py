"""An encoder-decoder (a tiny T5, shared embeddings tied to the head, dropout on) trained offloaded: every loss,
clipped norm, generate() between steps and the final weights equal the resident model's trained the same way
(torch.equal), for disk_offload, a checkpoint read in place with an offload_dir, and cpu_offload."""
import pytest
import torch

from swapio.offload import cpu_offload, disk_offload, remove_offload
from swapio.optim import OffloadAdamW
from helpers.hf_tiny import VOCAB, build_empty, inputs, resident, save
from helpers.offload import one_thread


def train(model, opt, clip, micro, steps=3):
    """`steps` steps of `micro` micro-batches (dropout seeded per step), greedy tokens after each step."""
    g = torch.Generator().manual_seed(5)
    losses, norms, tokens = [], [], []
    with one_thread():
        for s in range(steps):
            model.train()
            torch.manual_seed(100 + s)
            for _ in range(micro):
                ids, labels = torch.randint(2, VOCAB, (2, 7), generator=g), torch.randint(2, VOCAB, (2, 5), generator=g)
                loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                losses.append(loss.detach())
            if clip is not None:
                norms.append(clip(model, opt))
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                tokens.append(model.generate(inputs(), max_new_tokens=4, min_new_tokens=4, do_sample=False))
    return losses, norms, tokens


@pytest.mark.parametrize("storage,off,micro,in_backward", [("disk", "nvme", 2, False), ("ckpt", "cpu", 1, False),
                                                           ("cpu", "cpu", 1, True)])
def test_t5_trains_and_generates_like_resident(tmp_path, storage, off, micro, in_backward):
    ref = resident("t5")
    with OffloadAdamW(ref.parameters(), lr=1e-2, offload="cpu") as opt:
        clip = None if in_backward else (lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
        want = train(ref, opt, clip, micro)
    if storage == "ckpt":
        save("t5", tmp_path / "ckpt")
        model = disk_offload(build_empty("t5", "meta"), checkpoint=str(tmp_path / "ckpt"),
                             offload_dir=str(tmp_path / "od"))
    else:
        model = disk_offload(resident("t5"), str(tmp_path / "od")) if storage == "disk" else cpu_offload(resident("t5"))
    with OffloadAdamW(model.parameters(), lr=1e-2, offload=off, swap_dir=str(tmp_path), in_backward=in_backward) as opt:
        got = train(model, opt, None if in_backward else (lambda m, o: o.clip_grad_norm_(1.0)), micro)
    for g, w in zip(got, want):
        assert len(g) == len(w)
        assert all(torch.equal(a, b) for a, b in zip(g, w))
    remove_offload(model)
    got_sd, want_sd = model.state_dict(), ref.state_dict()
    assert got_sd.keys() == want_sd.keys()
    assert all(torch.equal(got_sd[k], want_sd[k]) for k in want_sd)
    assert not torch.equal(want_sd["shared.weight"], resident("t5").shared.weight)  # it did train
