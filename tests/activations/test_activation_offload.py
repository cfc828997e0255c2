"""offload_activations: gradients bit-equal to the run without it, views and layouts restored exactly, what is
offloaded and what never is, a second backward, checkpointing and autocast."""
import contextlib
import gc
import os
import warnings
import weakref

import pytest
import torch

from helpers.activations import (Stack, assert_same_grads, batch, grads_of, hooks_installed, make_stack, settle,
                                 swap_files)
from swapio import SwapioWarning
from swapio.offload import ActivationOffload, offload_activations
from swapio.offload import activation_store


def nvme(tmp_path, **kw):
    kw.setdefault("min_bytes", 0)
    return offload_activations(to="nvme", swap_dir=tmp_path, **kw)


@pytest.mark.parametrize("staging_bytes", [0, 1 << 14, 64 << 20], ids=["no-staging", "small", "large"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_gradients_bit_equal_to_no_offload_cpu_nvme(tmp_path, staging_bytes, prefetch):
    model, x = make_stack(), batch()
    want = grads_of(model, x)
    act = nvme(tmp_path, model=model, staging_bytes=staging_bytes, prefetch=prefetch)
    for _ in range(2):  # the same offloader, step after step
        assert_same_grads(grads_of(model, x, act), want)
    stats = act.stats()
    assert stats["tensors"] > 0 and stats["shared_views"] > 0  # the qkv views shared one offloaded storage
    if staging_bytes < (1 << 20):
        assert stats["read_bytes"] > 0  # came back from the disk, not from memory
        assert stats["peak_staged_bytes"] <= max(staging_bytes, max_storage_bytes(model, x))
    assert swap_files(act.directory) == [] and stats["live_sessions"] == 0
    act.close()


def max_storage_bytes(model, x):
    """The largest storage the forward saves (a single one may exceed the staging bound)."""
    sizes = []

    def pack(t):
        sizes.append(t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.clone().requires_grad_(True))
    return max(sizes)


class SaveViews(torch.autograd.Function):
    """Saves views of one storage with their own sizes, strides, offsets and dtypes; backward checks each comes
    back with exactly that layout, on one storage again."""

    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a, a.t(), a[1:, ::2], a.view(torch.int32), a.reshape(-1)[3:7])
        ctx.want = [(v.dtype, v.shape, v.stride(), v.storage_offset(), v.clone())
                    for v in (a, a.t(), a[1:, ::2], a.view(torch.int32), a.reshape(-1)[3:7])]
        return a * 2

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        ptrs = {t.untyped_storage().data_ptr() for t in saved}
        assert len(ptrs) == 1, "views of one storage come back on one storage"
        for t, (dtype, shape, stride, offset, values) in zip(saved, ctx.want):
            assert (t.dtype, t.shape, t.stride(), t.storage_offset()) == (dtype, shape, stride, offset)
            assert torch.equal(t, values)
        return g * 2


def test_views_come_back_with_their_layout_on_one_storage(tmp_path):
    base = torch.randn(6, 8)
    a = (base * 1).requires_grad_(False)  # a non-leaf activation
    x = base.clone().requires_grad_(True)
    with nvme(tmp_path, staging_bytes=0) as act:
        y = SaveViews.apply(x * 1)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert act.stats()["tensors"] == 1 and act.stats()["shared_views"] == 4
    del a


def offloaded_storages(monkeypatch):
    """The storages (data_ptr) the offloader takes, as they are taken."""
    seen = []
    real = activation_store.Session._offload

    def spy(self, tensor, storage, *rest):
        seen.append(storage.data_ptr())
        return real(self, tensor, storage, *rest)
    monkeypatch.setattr(activation_store.Session, "_offload", spy)
    return seen


def test_parameters_and_buffers_are_never_offloaded(tmp_path, monkeypatch):
    model, x = make_stack(), batch()
    seen = offloaded_storages(monkeypatch)
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    grads_of(model, x, nvme(tmp_path, model=model))
    assert seen and not own & set(seen)
    # without model=, parameters (and views of them, such as W.t()) still never are; the buffer is
    seen.clear()
    grads_of(model, x, nvme(tmp_path))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
    assert not params & set(seen) and buffers <= set(seen)


def test_min_bytes_keeps_small_storages_and_cpu_mode_keeps_cpu_tensors(tmp_path, monkeypatch):
    model, x = make_stack(), batch()
    want = grads_of(model, x)
    seen = offloaded_storages(monkeypatch)
    big = 2 * 8 * 4 * 32 * 4  # the MLP's hidden activations (b, t, 4 * dim) in fp32
    act = nvme(tmp_path, model=model, min_bytes=big)
    assert_same_grads(grads_of(model, x, act), want)
    assert seen and act.stats()["bytes"] == big * len(seen)
    seen.clear()
    act = offload_activations(to="cpu", min_bytes=0)  # a CPU model: nothing to move to the CPU
    with pytest.warns(SwapioWarning, match=r'(?s)offloaded nothing.*to="nvme"') as said:  # not silently
        assert_same_grads(grads_of(model, x, act), want)
    # it names the caller's line that left the block (grads_of's `with`), not torch.compile's wrapper of __exit__
    assert [w.filename for w in said if issubclass(w.category, SwapioWarning)] == [grads_of.__code__.co_filename]
    assert seen == [] and act.stats()["pinned_bytes"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per offloader; nor from to="nvme", which moves CPU tensors
        grads_of(model, x, act)
        grads_of(model, x, nvme(tmp_path, min_bytes=0))


def test_second_backward_with_retain_graph_reads_again(tmp_path):
    model, x = make_stack(), batch()
    want = grads_of(model, x, backward_twice=True)
    act = nvme(tmp_path, model=model, staging_bytes=0)
    assert_same_grads(grads_of(model, x, act, backward_twice=True), want)
    assert act.stats()["read_bytes"] > act.stats()["bytes"]  # the second backward read them again


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_nested_with_activation_checkpointing(tmp_path, monkeypatch, reentrant):
    model, x = make_stack(checkpoint=reentrant), batch()
    want = grads_of(make_stack(), x)  # checkpointing changes no gradient
    assert_same_grads(grads_of(model, x), want)
    seen = offloaded_storages(monkeypatch)
    act = nvme(tmp_path, model=model)
    assert_same_grads(grads_of(model, x, act), want)
    if reentrant:
        assert seen  # the segments' inputs, saved by the checkpoint function, were offloaded
    assert not hooks_installed() and swap_files(act.directory) == []


def test_autocast_bf16_on_the_cpu(tmp_path, monkeypatch):
    model, x = make_stack(), batch()

    def run(ctx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grads_of(model, x, ctx)
    want = run(None)
    seen = offloaded_storages(monkeypatch)
    assert_same_grads(run(nvme(tmp_path, model=model, staging_bytes=0)), want)
    assert seen


def test_nested_offloaders_each_take_their_own_forward(tmp_path):
    model, x = make_stack(depth=2), batch()
    want = grads_of(model, x)
    outer, inner = nvme(tmp_path / "a", model=model), nvme(tmp_path / "b", model=model)

    class Split(torch.nn.Module):
        def forward(self, x):
            h = model.blocks[0](x)
            with inner:
                return model.blocks[1](h)
    split = Split()
    split.named_parameters = model.named_parameters
    split.zero_grad = model.zero_grad
    assert_same_grads(grads_of(split, x, outer), want)
    assert outer.stats()["tensors"] > 0 and inner.stats()["tensors"] > 0
    assert not hooks_installed()


@pytest.fixture(autouse=True)
def _dirs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()


def test_inline_use_removes_its_directory_once_the_graph_is_gone(tmp_path):
    model, x = make_stack(), batch()
    xx = x.clone().requires_grad_(True)
    with offload_activations(to="nvme", swap_dir=tmp_path, min_bytes=0) as act:
        loss = model(xx).sum()
    directory = act.directory
    del act
    assert swap_files(directory)  # the graph still needs its file
    loss.backward()
    del loss
    gc.collect()
    assert not (tmp_path / directory).exists()


@pytest.mark.parametrize("staging_bytes", [0, 64 << 20], ids=["on-disk", "kept-in-ram"])
def test_a_with_around_several_steps_reuses_its_swap_file(tmp_path, staging_bytes):
    """A training loop inside one `with` (each backward in it too): every step's gradients as without offload, and
    the swap file and the session's bookkeeping hold one step's worth, not all of them (they grew step after step:
    the disk filled up)."""
    model, x = make_stack(), batch()
    want = [grads_of(model, x * (step + 1)) for step in range(6)]
    act = nvme(tmp_path, model=model, staging_bytes=staging_bytes)
    sizes = []
    with act:
        for step in range(6):
            assert_same_grads(grads_of(model, x * (step + 1)), want[step])  # (grads_of's `with` nests: none)
            (swap,) = swap_files(act.directory)
            sizes.append(os.stat(os.path.join(act.directory, swap)).st_size)
            (session,) = act._res.sessions
            assert session.live == 0 and len(session.entries) == 0
    assert sizes[1:] == sizes[:1] * 5
    assert act.stats()["tensors"] > 0 and swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    act.close()


def drop_a_graph_without_backward(ctx):
    """A forward whose exp saves its own (small) output, dropped without backward with the garbage collector off:
    whether that output is gone at once, as without offload."""
    a = torch.randn(512, 1024, requires_grad=True)
    gc.disable()
    try:
        with ctx:
            h = (a * 1).sin()  # saves a * 1 (2 MiB)
            small = h.sum(1).exp()  # saves its output (2 KiB: left in place)
            loss = small.sum()
        out = weakref.ref(small)
        del h, small, loss
        return out() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("to", ["cpu", "nvme"])
def test_a_graph_dropped_without_backward_frees_what_it_saved_at_once(tmp_path, to):
    """A saved output left in place held its own node (tensor -> grad_fn -> saved -> tensor): a cycle that kept the
    whole graph, and its swap file, until the garbage collector's next full pass."""
    assert drop_a_graph_without_backward(contextlib.nullcontext())  # the reference: no cycle without offload
    act = nvme(tmp_path, min_bytes=1 << 20) if to == "nvme" else offload_activations(to="cpu")
    assert drop_a_graph_without_backward(act)
    assert swap_files(act.directory) == [] and act.stats()["live_sessions"] == 0
    assert to == "cpu" or act.stats()["tensors"] == 1
    act.close()


def test_close_discards_what_a_graph_still_holds(tmp_path):
    model, x = make_stack(), batch()
    act = nvme(tmp_path, staging_bytes=0)
    with act:
        loss = model(x.clone().requires_grad_(True)).sum()
    directory = act.directory
    act.close()
    assert not (tmp_path / directory).exists()
    with pytest.raises(RuntimeError, match="discarded"):
        loss.backward()
    with pytest.raises(RuntimeError, match="closed"):
        with act:
            pass


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(to="gpu"), ValueError, "to must be"),
    (dict(to="nvme"), ValueError, "needs swap_dir"),
    (dict(to="nvme", swap_dir=__file__), ValueError, "not a directory"),
    (dict(to="cpu", swap_dir="."), ValueError, "swap_dir is for"),
    (dict(to="cpu", queue_depth=4), TypeError, "no file I/O"),
    (dict(min_bytes=-1), ValueError, "min_bytes"),
    (dict(prefetch=1.5), TypeError, "prefetch"),
    (dict(model="gpt2"), TypeError, "model must be"),
    (dict(to="nvme", swap_dir=123), TypeError, "swap_dir must be a path"),
    (dict(to="nvme", swap_dir=".", queue_dept=4), TypeError, "offload_activations.*queue_dept.*queue_depth"),
])
def test_bad_arguments_name_the_problem(kwargs, error, match):
    with pytest.raises(error, match=match):
        offload_activations(**kwargs)


def test_a_swap_dir_given_as_bytes_works_as_a_str_one(tmp_path):
    """(bytes paths are paths too: they failed with "startswith first arg must be bytes".)"""
    model, x = make_stack(), batch()
    act = offload_activations(to="nvme", swap_dir=os.fsencode(tmp_path), min_bytes=0)
    assert_same_grads(grads_of(model, x, act), grads_of(model, x))
    directory = act.directory
    assert act.stats()["tensors"] > 0 and directory.startswith(str(tmp_path))
    act.close()
    assert not os.path.exists(directory)


@pytest.mark.parametrize("switch", ["enable", "disable"])
def test_the_model_switch_names_a_model_that_is_not_a_module(switch):
    from swapio.offload import disable_activation_offload, enable_activation_offload
    call = enable_activation_offload if switch == "enable" else disable_activation_offload
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        call("gpt2")


def test_public_name():
    import swapio.offload
    assert "offload_activations" in swapio.offload.__all__
    assert isinstance(offload_activations(), ActivationOffload)
    assert Stack  # the helpers' model is importable


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("to", ["cpu", "nvme"])
def test_cuda_gradients_bit_equal_to_no_offload(tmp_path, to):
    model, x = make_stack().cuda(), batch().cuda()
    want = grads_of(model, x)
    kw = dict(swap_dir=tmp_path, staging_bytes=1 << 14) if to == "nvme" else {}
    act = offload_activations(to=to, model=model, min_bytes=0, **kw)
    for _ in range(2):
        assert_same_grads(grads_of(model, x, act), want)
    assert act.stats()["tensors"] > 0 and act.stats()["shared_views"] > 0
    act.close()
    assert act.stats()["pinned_bytes"] == 0


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("to", ["cpu", "nvme"])
@pytest.mark.parametrize("when", ["while-copied-out", "after"])
def test_cuda_tensor_changed_in_place(tmp_path, to, when):
    """Changed while its copy to the host may still read it: the backward raises autograd's error; changed after
    the copy was seen finished: it comes back as saved."""
    from swapio.core.cuda_copy import copy_stream
    act = offload_activations(to=to, min_bytes=0, **(dict(swap_dir=tmp_path) if to == "nvme" else {}))
    a = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    if when == "while-copied-out":
        with torch.cuda.stream(copy_stream(a.device, "to_host")):
            torch.cuda._sleep(200_000_000)  # (about 0.1 s) the copies out of the forward below wait behind it
    with act:
        b = a * 1
        d = (b.sin() * 2).exp()  # the sin saves b
    if when == "after":
        settle(act)
    b.add_(1)
    if when == "after":
        d.sum().backward()
        torch.testing.assert_close(a.grad, (2 * a.detach().sin()).exp() * 2 * a.detach().cos(), rtol=0, atol=0)
    else:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            d.sum().backward()
    del b, d
    act.close()


@pytest.mark.gpu
@cuda
def test_cuda_second_backward_and_cpu_tensors_stay(tmp_path, monkeypatch):
    model, x = make_stack().cuda(), batch().cuda()
    want = grads_of(model, x, backward_twice=True)
    act = offload_activations(to="cpu", model=model, min_bytes=0)
    assert_same_grads(grads_of(model, x, act, backward_twice=True), want)
    seen = offloaded_storages(monkeypatch)
    cpu_model = make_stack()
    grads_of(cpu_model, batch(), act)
    assert seen == []


def test_a_swap_dir_that_does_not_exist_is_made_as_the_optimizers_make_theirs(tmp_path):
    # (it was a ValueError, where OffloadAdamW(offload="nvme") and SwapStore make the directory)
    swap_dir = tmp_path / "a" / "b"
    act = offload_activations(to="nvme", swap_dir=swap_dir, min_bytes=0)
    assert act.directory.startswith(str(swap_dir) + os.sep)
    x = torch.randn(64, 64, requires_grad=True)
    with act:
        loss = (x * 2).sin().sum()
    loss.backward()
    assert torch.equal(x.grad, (2 * (x * 2).cos()).detach())
    act.close()
    assert os.listdir(swap_dir) == []


def test_a_swap_dir_that_cannot_be_made_is_an_os_error_naming_it(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError, match="cannot create swap_dir") as info:
        offload_activations(to="nvme", swap_dir=tmp_path / "file" / "under")
    assert info.value.filename == str(tmp_path / "file" / "under")
