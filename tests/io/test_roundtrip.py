"""Byte-for-byte round trips through AioHandle: what pwrite puts in the file (checked with plain Python reads)
and what pread brings back, over dtypes, sizes, file offsets, memory alignment, engines, threads, block sizes
and O_DIRECT modes."""
import os

import pytest
import torch

import swapio
from conftest import (ENGINE_PARAMS, MiB, TIMEOUT, as_bytes, random_bytes, read_file, unaligned_uint8)

SIZES = [0, 1, 511, 512, 4095, 4096, 4097, MiB + 3]
OFFSETS = [0, 1, 512, 513, 4096, 4097]


def roundtrip(h, src, path, offset=0):
    """Writes src at offset, checks the file with open(), reads it back into a fresh tensor; returns that."""
    nbytes = src.numel() * src.element_size()
    assert h.pwrite(src, path, offset).wait(timeout=TIMEOUT) == nbytes
    data = read_file(path)
    assert data[offset:offset + nbytes] == as_bytes(src)
    out = torch.empty_like(src)
    assert h.pread(out, path, offset).wait(timeout=TIMEOUT) == nbytes
    assert as_bytes(out) == as_bytes(src)
    return out, data


def tensor_of(dtype, numel, seed=0):
    if dtype == torch.bool:
        g = torch.Generator().manual_seed(seed)
        return torch.rand(numel, generator=g) > 0.5
    itemsize = torch.empty((), dtype=dtype).element_size()
    return random_bytes(numel * itemsize, seed).view(dtype)  # every bit pattern, NaNs included


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool,
                                   torch.complex64], ids=lambda d: str(d).replace("torch.", ""))
def test_roundtrip_preserves_every_byte_of_dtype(handle_factory, tmp_path, engine, dtype):
    h = handle_factory(engine=engine, block_size=8192)
    src = tensor_of(dtype, 10007, seed=1).reshape(-1)
    path = tmp_path / "t.bin"
    out, data = roundtrip(h, src, path)
    assert out.dtype == dtype
    assert len(data) == src.numel() * src.element_size()


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("nbytes", SIZES, ids=lambda n: f"{n}B")
def test_roundtrip_of_size_writes_exactly_nbytes(handle_factory, tmp_path, engine, nbytes):
    h = handle_factory(engine=engine)
    src = random_bytes(nbytes, seed=nbytes)
    path = tmp_path / "t.bin"
    _, data = roundtrip(h, src, path)
    assert os.path.getsize(path) == nbytes
    assert data == as_bytes(src)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 3], ids=lambda t: f"threads{t}")
def test_roundtrip_of_64MiB(handle_factory, tmp_path, threads):
    h = handle_factory(threads=threads)
    src = random_bytes(64 * MiB, seed=64)
    path = tmp_path / "big.bin"
    _, data = roundtrip(h, src, path)
    assert len(data) == 64 * MiB


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("offset", OFFSETS, ids=lambda o: f"offset{o}")
def test_write_at_file_offset_lands_exactly_there(handle_factory, tmp_path, engine, offset):
    h = handle_factory(engine=engine, block_size=4096)
    src = random_bytes(3 * 4096 + 5, seed=offset)
    path = tmp_path / "t.bin"
    _, data = roundtrip(h, src, path, offset)
    assert len(data) == offset + src.numel()
    assert data[:offset] == bytes(offset)  # the hole before the offset reads as zeros
    assert data[offset:] == as_bytes(src)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_pwrite_leaves_bytes_outside_its_range_untouched(handle_factory, tmp_path, engine):
    h = handle_factory(engine=engine, block_size=4096)
    path = tmp_path / "t.bin"
    before = os.urandom(5 * 4096)
    path.write_bytes(before)
    src = random_bytes(4096 + 700, seed=3)
    assert h.pwrite(src, path, 1000).wait(timeout=TIMEOUT) == src.numel()
    after = read_file(path)
    assert after[:1000] == before[:1000]
    assert after[1000:1000 + src.numel()] == as_bytes(src)
    assert after[1000 + src.numel():] == before[1000 + src.numel():]


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("offset", [0, 4096, 513], ids=lambda o: f"offset{o}")
def test_pread_at_offset_returns_that_range_of_a_plain_file(handle_factory, tmp_path, engine, offset):
    h = handle_factory(engine=engine, block_size=4096)
    path = tmp_path / "plain.bin"
    content = os.urandom(40000)
    path.write_bytes(content)
    out = torch.empty(30000, dtype=torch.uint8)
    assert h.pread(out, path, offset).wait(timeout=TIMEOUT) == 30000
    assert as_bytes(out) == content[offset:offset + 30000]


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("direct", [None, True, False], ids=lambda d: f"direct{d}")
@pytest.mark.parametrize("offset", [0, 513], ids=lambda o: f"offset{o}")
def test_roundtrip_from_unaligned_memory(handle_factory, tmp_path, engine, direct, offset):
    h = handle_factory(engine=engine, direct=direct, block_size=64 * 1024)
    src = unaligned_uint8(MiB + 3, seed=7)
    path = tmp_path / "t.bin"
    assert h.pwrite(src, path, offset).wait(timeout=TIMEOUT) == src.numel()
    assert read_file(path)[offset:] == as_bytes(src)
    out = torch.empty(MiB + 4, dtype=torch.uint8)[1:]  # read into misaligned memory as well
    assert h.pread(out, path, offset).wait(timeout=TIMEOUT) == src.numel()
    assert torch.equal(out, src)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_roundtrip_from_unaligned_view_of_pinned_buffer(handle_factory, tmp_path, engine):
    h = handle_factory(engine=engine, block_size=64 * 1024)
    buf = swapio.empty_pinned((MiB + 4,), torch.uint8)
    src = buf[1:]
    src.copy_(random_bytes(MiB + 3, seed=8))
    path = tmp_path / "t.bin"
    assert h.pwrite(src, path).wait(timeout=TIMEOUT) == src.numel()
    assert read_file(path) == as_bytes(src)
    out_buf = swapio.empty_pinned((MiB + 4,), torch.uint8)
    out = out_buf[1:]
    assert h.pread(out, path).wait(timeout=TIMEOUT) == src.numel()
    assert torch.equal(out, src)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_roundtrip_of_aligned_pinned_tensor(handle_factory, tmp_path, engine):
    h = handle_factory(engine=engine, direct=True)
    src = swapio.empty_pinned((MiB // 4,), torch.float32)
    src.view(torch.uint8).copy_(random_bytes(MiB, seed=9))
    path = tmp_path / "t.bin"
    out, data = roundtrip(h, src, path)
    assert len(data) == MiB
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("offset", [0, 4096, 4097], ids=lambda o: f"offset{o}")
def test_staged_requests_go_through_the_bounce_buffers_and_roundtrip(handle_factory, tmp_path, engine, offset):
    """staged=True: aligned memory takes the bounce-buffer path (the workers' buffers appear only then) and every
    byte arrives, both ways (at 4097 the memory is off the file's alignment anyway)."""
    h = handle_factory(engine=engine, direct=True, block_size=64 * 1024)
    src = swapio.empty_pinned((3 * MiB + 4096,), torch.uint8)
    src.copy_(random_bytes(src.numel(), seed=12))
    path = tmp_path / "t.bin"
    before = swapio._C.held_bytes()["bounce"]
    if offset % 4096 == 0:  # memory and file aligned alike: straight from src unless staged
        assert h.pwrite(src, path, offset).wait(timeout=TIMEOUT) == src.numel()
        assert swapio._C.held_bytes()["bounce"] == before
    assert h.pwrite(src, path, offset, staged=True).wait(timeout=TIMEOUT) == src.numel()
    assert swapio._C.held_bytes()["bounce"] > before
    assert read_file(path)[offset:] == as_bytes(src)
    out = swapio.empty_pinned((src.numel(),), torch.uint8)
    out.fill_(0)
    assert h.pread(out, path, offset, staged=True).wait(timeout=TIMEOUT) == src.numel()
    assert torch.equal(out, src)


def test_staged_auto_stages_ordinary_memory_and_not_pinned_memory(handle_factory, tmp_path):
    path = tmp_path / "t.bin"
    src = random_bytes(2 * MiB, seed=13)
    with open(path, "wb") as f:
        f.write(as_bytes(src))
    backing = torch.empty(2 * MiB + 4096, dtype=torch.uint8)
    plain = backing[(-backing.data_ptr()) % 4096:][:2 * MiB]  # aligned, so only "auto" can make it bounce
    for memory, bounces in ((swapio.empty_pinned((2 * MiB,), torch.uint8), False), (plain, True)):
        h = handle_factory(direct=True)
        before = swapio._C.held_bytes()["bounce"]
        assert h.pread(memory, path, staged="auto").wait(timeout=TIMEOUT) == 2 * MiB
        assert torch.equal(memory, src)
        assert (swapio._C.held_bytes()["bounce"] > before) == bounces
        h.close()


def test_staged_must_be_a_bool_or_auto(handle_factory, tmp_path):
    h = handle_factory()
    with pytest.raises(TypeError, match="staged must be True, False or 'auto'"):
        h.pread(torch.empty(4096, dtype=torch.uint8), tmp_path / "t.bin", staged=1)
    with pytest.raises(ValueError, match="staged must be True, False or 'auto'"):
        h.pwrite(torch.empty(4096, dtype=torch.uint8), tmp_path / "t.bin", staged="always")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("threads", [1, 3], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("offset", [0, 4097], ids=lambda o: f"offset{o}")
def test_many_small_blocks_over_threads_roundtrip(handle_factory, tmp_path, engine, threads, offset):
    """block_size 4096 with 1 MiB + 3 bytes: hundreds of pieces, spread over `threads` workers."""
    h = handle_factory(engine=engine, threads=threads, block_size=4096, queue_depth=8)
    src = random_bytes(MiB + 3, seed=threads + offset)
    path = tmp_path / "t.bin"
    _, data = roundtrip(h, src, path, offset)
    assert len(data) == offset + MiB + 3


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("direct", [None, True, False], ids=lambda d: f"direct{d}")
def test_roundtrip_in_direct_mode(handle_factory, tmp_path, engine, direct, fresh_warnings, recwarn):
    h = handle_factory(engine=engine, direct=direct, block_size=128 * 1024)
    src = random_bytes(MiB + 3, seed=11)
    path = tmp_path / "t.bin"
    _, data = roundtrip(h, src, path, 4096)
    assert len(data) == 4096 + MiB + 3
    # tmp_path is on a disk file system that takes O_DIRECT: no fallback warning.
    assert not [w for w in recwarn if issubclass(w.category, swapio.SwapioWarning)]


def test_tmp_path_accepts_o_direct(tmp_path):
    """The round trips above rely on tmp_path taking O_DIRECT (else they would not test it)."""
    assert swapio.info(tmp_path)["path"]["direct"] is True


def test_multidimensional_tensor_roundtrips_in_memory_order(handle_factory, tmp_path):
    h = handle_factory()
    src = torch.arange(3 * 5 * 7, dtype=torch.float32).reshape(3, 5, 7)
    path = tmp_path / "t.bin"
    out, data = roundtrip(h, src, path)
    assert data == src.numpy().tobytes()
    assert torch.equal(out, src)


def test_zero_length_write_creates_empty_file(handle_factory, tmp_path):
    h = handle_factory()
    path = tmp_path / "empty.bin"
    assert h.pwrite(torch.empty(0), path).wait(timeout=TIMEOUT) == 0
    assert path.exists() and os.path.getsize(path) == 0


def test_null_engine_completes_every_piece_with_full_length(handle_factory, tmp_path):
    """The null engine moves no data but runs the splitting: the request reports all its bytes."""
    h = handle_factory(engine="null", block_size=4096, queue_depth=4, threads=3)
    assert h.engine == "null"
    src = random_bytes(MiB + 3)
    futures = [h.pwrite(src, tmp_path / "null.bin", off) for off in (0, 1, 4097)]
    assert [f.wait(timeout=TIMEOUT) for f in futures] == [MiB + 3] * 3
    out = torch.empty(MiB + 3, dtype=torch.uint8)
    assert h.pread(out, tmp_path / "null.bin", 513).wait(timeout=TIMEOUT) == MiB + 3


def test_future_reports_done_result_and_no_exception(handle_factory, tmp_path):
    h = handle_factory()
    src = random_bytes(10000)
    f = h.pwrite(src, tmp_path / "t.bin")
    assert isinstance(f, swapio.Future)
    assert f.wait(timeout=TIMEOUT) == 10000
    assert f.done()
    assert f.result(timeout=TIMEOUT) == 10000  # waiting again gives the same value
    assert f.exception(timeout=TIMEOUT) is None


def test_context_manager_closes_handle(tmp_path):
    with swapio.AioHandle() as h:
        assert h.pwrite(random_bytes(100), tmp_path / "t.bin").wait(timeout=TIMEOUT) == 100
        assert not h.closed
    assert h.closed


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_explicit_engine_is_the_one_used(handle_factory, engine):
    assert handle_factory(engine=engine).engine == engine


def test_auto_engine_resolves_to_the_one_info_reports(handle_factory):
    assert handle_factory(engine="auto").engine == swapio.info()["auto_engine"]


def test_swapio_engine_environment_variable_forces_auto(handle_factory, monkeypatch):
    monkeypatch.setenv("SWAPIO_ENGINE", "psync")
    assert handle_factory(engine="auto").engine == "psync"
    assert handle_factory(engine="aio").engine == "aio"  # an explicit engine wins over the variable


def test_from_config_dict_builds_that_handle(tmp_path):
    h = swapio.AioHandle.from_config({"block_size": 8192, "queue_depth": 4, "threads": 2, "engine": "psync",
                                      "direct": False})
    try:
        assert (h.block_size, h.queue_depth, h.threads, h.engine, h.direct) == (8192, 4, 2, "psync", False)
        assert roundtrip(h, random_bytes(20000), tmp_path / "t.bin")[1][:20000] == as_bytes(random_bytes(20000))
    finally:
        h.close()


def test_from_config_reads_json_file_with_handle_section(tmp_path):
    import json
    cfg = tmp_path / "swapio.json"
    cfg.write_text(json.dumps({"handle": {"block_size": 65536, "queue_depth": 16, "engine": "psync"}}))
    h = swapio.AioHandle.from_config(cfg)
    try:
        assert (h.block_size, h.queue_depth, h.engine) == (65536, 16, "psync")
        assert h.config()["block_size"] == 65536
    finally:
        h.close()


def test_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="bogus"):
        swapio.AioHandle.from_config({"block_size": 4096, "bogus": 1})
