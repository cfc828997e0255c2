"""Every forward reads each byte once, the first included: a transformers Llama registers its norms after
attention and MLP but runs them before, and the first forward (before the order was learned) used to drop the
current layer's reads ahead and read them again (2.4-5x the checkpoint). Reads are counted at the I/O layer
(every pread the handle receives), with a ring smaller than the model."""
import collections

import pytest
import torch

import swapio
from swapio.offload import disk_offload, remove_offload, stats
from swapio.offload.api import _offloaded

transformers = pytest.importorskip("transformers")


class CountingHandle(swapio.AioHandle):
    """An AioHandle that counts reads by (path, offset, bytes)."""

    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()

    def pread(self, tensor, path, offset=0, **kw):
        self.reads[(str(path), offset, tensor.numel())] += 1
        return super().pread(tensor, path, offset, **kw)


def llama():
    # 4 layers of 256 wide: 10 MiB of fp32 weights, records of 4 KiB to 512 KiB
    return transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


@pytest.mark.slow
@pytest.mark.parametrize("ring_kib", [300, 1024, 2048])
def test_each_forward_reads_the_checkpoint_once_first_included(tmp_path, ring_kib):
    torch.manual_seed(0)
    resident = transformers.LlamaForCausalLM(llama()).eval()
    resident.save_pretrained(tmp_path)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = resident(ids).logits
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama()).eval()
    with CountingHandle() as handle:
        disk_offload(model, checkpoint=tmp_path, buffer_bytes=ring_kib << 10, handle=handle)
        engine = _offloaded[model]
        total = sum(length for r in engine.records for _, _, length, _ in r.spans)
        assert ring_kib << 10 < total / 4
        for forward in range(1, 4):
            with torch.no_grad():
                assert torch.equal(model(ids).logits, want)
            ahead = set(engine.fetcher.fetches)  # read already for the next forward's first modules
            for record in engine.records:
                for path, offset, length, _ in record.spans:
                    assert handle.reads[(path, offset, length)] == forward + (record in ahead), record
            assert stats(model)["bytes_read"] == forward * total + sum(
                length for r in ahead for _, _, length, _ in r.spans)
        remove_offload(model)
