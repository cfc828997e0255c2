"""The CUDA execution path (side copy stream, events, pinned regions reused only after the copy out of them) and
the SwapStore staging fixes. Skipped without CUDA."""
import pytest
import torch

import swapio
from swapio.offload import cpu_offload, cpu_offload_with_hook, disk_offload, load_file, remove_offload, stats
from helpers.offload import NEW_TOKENS, reference, resident_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_reference():
    model = resident_model().cuda()
    ids = reference()[0].cuda()
    with torch.no_grad():
        return ids, model(ids).logits, model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def check(model):
    ids, logits, tokens = gpu_reference()
    with torch.no_grad():
        got = model(ids).logits
        assert got.device.type == "cuda"
        torch.testing.assert_close(got, logits)
        assert torch.equal(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0), tokens)


@pytest.mark.parametrize("kind", ["cpu", "disk", "disk-tiny-ring", "checkpoint"])
def test_offloaded_model_on_cuda_matches_resident(tmp_path, kind):
    model = resident_model()
    if kind == "cpu":
        cpu_offload(model, execution_device="cuda", prefetch=2)
    elif kind == "checkpoint":
        model.save_pretrained(tmp_path / "ck")
        disk_offload(model, execution_device="cuda", checkpoint=tmp_path / "ck")
    else:
        disk_offload(model, tmp_path / "od", execution_device="cuda",
                     buffer_bytes=(256 << 20) if kind == "disk" else 64 << 10)
    check(model)
    assert stats(model)["copies"] > 0
    remove_offload(model)
    assert all(p.device.type == "cuda" for p in model.parameters())
    check(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["cpu", "disk", "checkpoint"])
def test_streamed_weights_sit_256_byte_aligned_and_give_the_resident_logits_exactly(tmp_path, kind, dtype):
    resident = resident_model().to(dtype).cuda()
    ids = reference()[0].cuda()
    with torch.no_grad():
        expected = resident(ids).logits
    model = resident_model().to(dtype)
    if kind == "cpu":
        cpu_offload(model, execution_device="cuda")
    elif kind == "checkpoint":  # tensors packed after the header at offsets like 168 or 184 in the file
        model.save_pretrained(tmp_path / "ck")
        disk_offload(model, execution_device="cuda", checkpoint=tmp_path / "ck")
    else:
        disk_offload(model, tmp_path / "od", execution_device="cuda")
    seen, linear, addmm = [], torch.nn.functional.linear, torch.addmm

    def spy_linear(x, weight, bias=None):  # lm_head
        seen.append(weight.data_ptr() % 256)
        return linear(x, weight, bias)

    def spy_addmm(bias, x, weight, **kwargs):  # GPT-2's Conv1D layers
        seen.extend((weight.data_ptr() % 256, bias.data_ptr() % 256))
        return addmm(bias, x, weight, **kwargs)
    torch.nn.functional.linear, torch.addmm = spy_linear, spy_addmm
    try:
        with torch.no_grad():
            got = model(ids).logits
    finally:
        torch.nn.functional.linear, torch.addmm = linear, addmm
    assert seen and set(seen) == {0}
    assert torch.equal(got, expected)  # the same cuBLAS kernels as resident: bit-equal
    remove_offload(model)


def test_cpu_offload_with_hook_chain_moves_models_in_and_out():
    a, b = resident_model(), resident_model()
    a, hook_a = cpu_offload_with_hook(a, execution_device="cuda")
    b, hook_b = cpu_offload_with_hook(b, execution_device="cuda", prev_module_hook=hook_a)
    assert a.lm_head.weight.device.type == "cpu"
    ids = reference()[0]
    with torch.no_grad():
        a(ids)
        assert a.lm_head.weight.device.type == "cuda"
        b(ids)
        assert a.lm_head.weight.device.type == "cpu" and b.lm_head.weight.device.type == "cuda"
    hook_b.offload()
    assert b.lm_head.weight.device.type == "cpu" and b.lm_head.weight is b.transformer.wte.weight
    hook_a.remove()
    hook_b.remove()


def test_swap_in_to_cuda_refills_a_released_gpu_tensor(tmp_path):
    with swapio.SwapStore(tmp_path) as store:
        t = torch.randn(1 << 20, device="cuda")
        want = t.clone()
        s = store.swap_out(t)
        s.wait()
        assert t.untyped_storage().nbytes() == 0
        f = s.swap_in(device="cuda")  # "cuda" means the current device: the released tensor itself is refilled
        assert f.wait(timeout=60) is t and f.done()
        assert torch.equal(t, want)


def test_swap_in_out_tensor_waits_for_earlier_work_only(tmp_path):
    with swapio.SwapStore(tmp_path) as store:
        src = torch.randn(1 << 20)
        s = store.swap_out(src, release=False)
        s.wait()
        out = torch.zeros(1 << 20, device="cuda")
        out.add_(1)  # queued before swap_in: the copy must come after it
        got = s.swap_in(device="cuda", out=out).wait(timeout=60)
        assert got is out and torch.equal(out.cpu(), src)


def test_checkpoint_load_into_gpu_tensors_comes_after_the_work_queued_on_them(tmp_path):
    saved = torch.randn(1 << 20)
    swapio.checkpoint.save({"w": saved}, tmp_path / "c.safetensors")
    w = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(100_000_000)  # the GPU is busy: what follows is still queued when load() runs
    w.add_(1)  # queued before the load: the copies into w must come after it
    swapio.checkpoint.load(tmp_path / "c.safetensors", device="cuda", out={"w": w})
    assert torch.equal(w.cpu(), saved)


def test_load_file_to_cuda(tmp_path):
    resident_model().save_pretrained(tmp_path / "ck", max_shard_size="100KB")
    cpu = load_file(tmp_path / "ck")
    gpu = load_file(tmp_path / "ck", device="cuda", staging_bytes=64 << 10)
    assert cpu.keys() == gpu.keys()
    for k in cpu:
        assert gpu[k].device.type == "cuda" and torch.equal(gpu[k].cpu(), cpu[k])


class EndsEmpty(torch.nn.Module):
    """A large weight, then an empty buffer: the model's last tensor has no copy."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("empty", torch.empty(0))

    def forward(self, x):
        return x @ self.weight


def test_cpu_offload_with_hook_waits_for_the_copies_when_the_last_tensor_is_empty():
    model = EndsEmpty()
    x = torch.randn(8, 4096)
    want = model(x)
    model, hook = cpu_offload_with_hook(model, execution_device="cuda")
    for _ in range(3):  # the compute stream must wait for the 64 MiB copy, not for the empty tensor's nothing
        got = model(x)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)
        hook.offload()
    hook.remove()


def test_a_forward_after_an_interrupted_hook_offload_works_and_keeps_device_changes():
    """Ctrl-C inside hook.offload() leaves some tensors back in host memory and some on the device (Ctrl-C
    on the cpu_offload_with_hook path): the next forward finishes the offload, then loads them all."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    x = torch.randn(4, 64)
    model, hook = cpu_offload_with_hook(model, execution_device="cuda")
    model(x)
    with torch.no_grad():
        model[1].weight.add_(1.0)  # a change made on the device, which offload() must keep
    want = torch.nn.functional.linear(model[0](x.cuda()), model[1].weight, model[1].bias).cpu()
    host = hook._host[model[0].weight]
    with torch.no_grad():
        host.copy_(model[0].weight.data)
    model[0].weight.data = host  # what offload() had done for this tensor when Ctrl-C arrived
    torch.testing.assert_close(model(x).cpu(), want)
    hook.remove()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_inputs_on_meta_are_refused_before_the_move_to_cuda(tmp_path, kind):
    """`inputs.to(model.device)` (meta for an offloaded model): swapio's pre-hook names the input and the
    execution device instead of torch's "Cannot copy out of meta tensor" from the move to CUDA."""
    model = resident_model()
    if kind == "cpu":
        cpu_offload(model, execution_device="cuda")
    else:
        disk_offload(model, tmp_path / "od", execution_device="cuda")
    ids = reference()[0]
    with pytest.raises(RuntimeError, match=r"input_ids is on the meta device(.|\n)*execution device \(cuda:0\)"):
        model(input_ids=ids.to(model.device))
    check(model)
    remove_offload(model)
