"""torch.nn.Embedding(max_norm=...) renormalizes the rows it looks up in place in every forward. Offloaded, the
renormalization was lost (the next forward read the stored weight again, a swapio optimizer stepped from its own
master), so a tied head and training drifted from the resident model without a word. Offloading such a module is
now a ValueError naming it and keep_resident; kept resident, the model equals the resident one."""
import pytest
import torch

from helpers.offload_training import Tied, assert_trains_as_resident, batches, offload

pytest.importorskip("safetensors")


class Renormed(torch.nn.Module):
    VOCAB, DIM = Tied.VOCAB, Tied.DIM

    def __init__(self, bag=False):
        super().__init__()
        kind = torch.nn.EmbeddingBag if bag else torch.nn.Embedding
        self.emb = kind(self.VOCAB, self.DIM, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # rows above max_norm: the forward renormalizes them
        self.mid = torch.nn.Linear(self.DIM, self.DIM)
        self.head = torch.nn.Linear(self.DIM, self.VOCAB, bias=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def build():
    torch.manual_seed(0)
    return Renormed()


@pytest.mark.parametrize("bag", [False, True])
@pytest.mark.parametrize("storage", ["disk", "cpu", "ckpt"])
def test_offloading_an_embedding_with_max_norm_is_refused(tmp_path, storage, bag):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"emb is a torch\.nn\.Embedding(Bag)? with max_norm=1\.0.*keep_resident"):
        offload(Renormed(bag), storage, tmp_path, Renormed)


@pytest.mark.parametrize("storage", ["disk", "cpu", "ckpt"])
def test_an_embedding_with_max_norm_kept_resident_trains_as_resident(tmp_path, storage):
    model = offload(build(), storage, tmp_path, Renormed, keep_resident=["emb"])
    assert_trains_as_resident(model, build(), batches(Tied, 3), tmp_path)
