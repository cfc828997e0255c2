"""Every error a caller can meet: bad arguments (TypeError/ValueError at the call), OS errors (OSError with
errno, filename and offset, at wait()), reads past the end of a file (ENODATA), timeouts and closed handles."""
import errno
import os
import subprocess
import sys
import shutil
import textwrap
import warnings

import pytest
import torch

import swapio
from conftest import ENGINE_PARAMS, REPO, TIMEOUT, queued_behind_big_read, random_bytes, read_file


def raised(future):
    with pytest.raises(OSError) as info:
        future.wait(timeout=TIMEOUT)
    return info.value


# ---------------------------------------------------------------- bad arguments, raised at the call

@pytest.mark.parametrize("offset", [-1, -4096], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_negative_offset_is_value_error(handle_factory, tmp_path, op, offset):
    h = handle_factory()
    (tmp_path / "f").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="offset"):
        getattr(h, op)(torch.zeros(10, dtype=torch.uint8), tmp_path / "f", offset)


@pytest.mark.parametrize("offset", [1.0, "0", None, True], ids=["float", "str", "None", "bool"])
def test_non_int_offset_is_type_error(handle_factory, tmp_path, offset):
    h = handle_factory()
    with pytest.raises(TypeError, match="offset"):
        h.pwrite(torch.zeros(10, dtype=torch.uint8), tmp_path / "f", offset)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("offset", [2 ** 63, 2 ** 64 + 1], ids=["2**63", "2**64+1"])
def test_offset_beyond_int64_is_value_error(handle_factory, tmp_path, offset):
    with pytest.raises(ValueError, match="offset"):
        handle_factory().pwrite(torch.zeros(10, dtype=torch.uint8), tmp_path / "f", offset)


def test_offset_plus_length_overflow_is_value_error(handle_factory, tmp_path):
    with pytest.raises(ValueError, match="overflow"):
        handle_factory().pwrite(torch.zeros(10, dtype=torch.uint8), tmp_path / "f", 2 ** 63 - 5)


def test_write_beyond_max_file_size_is_efbig(handle_factory, tmp_path):
    path = tmp_path / "huge.bin"
    with pytest.raises(OSError) as info:
        handle_factory().pwrite(torch.zeros(10, dtype=torch.uint8), path, 2 ** 62).wait(timeout=TIMEOUT)
    assert info.value.errno in (errno.EFBIG, errno.EINVAL)
    assert info.value.filename == str(path)


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_non_contiguous_tensor_is_value_error(handle_factory, tmp_path, op):
    h = handle_factory()
    t = torch.zeros(8, 8).t()
    assert not t.is_contiguous()
    with pytest.raises(ValueError, match="contiguous"):
        getattr(h, op)(t, tmp_path / "f")


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_meta_device_tensor_is_value_error(handle_factory, tmp_path, op):
    h = handle_factory()
    with pytest.raises(ValueError, match="CPU"):
        getattr(h, op)(torch.empty(16, device="meta"), tmp_path / "f")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_cuda_tensor_is_value_error(handle_factory, tmp_path):
    h = handle_factory()
    with pytest.raises(ValueError, match="CPU"):
        h.pwrite(torch.zeros(16, device="cuda"), tmp_path / "f")


@pytest.mark.parametrize("obj", [b"bytes", bytearray(8), [1, 2, 3], None], ids=["bytes", "bytearray", "list", "None"])
@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_non_tensor_is_type_error(handle_factory, tmp_path, op, obj):
    h = handle_factory()
    with pytest.raises(TypeError, match="tensor"):
        getattr(h, op)(obj, tmp_path / "f")


def test_numpy_array_is_type_error(handle_factory, tmp_path):
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="tensor"):
        handle_factory().pwrite(np.zeros(8, dtype=np.uint8), tmp_path / "f")


@pytest.mark.parametrize("path", [3, 1.5, None], ids=["int", "float", "None"])
def test_non_path_is_type_error(handle_factory, path):
    with pytest.raises(TypeError, match="path"):
        handle_factory().pwrite(torch.zeros(4), path)


def test_empty_path_is_value_error(handle_factory):
    with pytest.raises(ValueError, match="path"):
        handle_factory().pwrite(torch.zeros(4), "")


def test_path_with_nul_byte_is_value_error(handle_factory, tmp_path):
    with pytest.raises(ValueError):
        handle_factory().pwrite(torch.zeros(4), str(tmp_path / "a\0b"))


@pytest.mark.parametrize("option", ["block_size", "queue_depth", "threads"])
@pytest.mark.parametrize("value", [0, -1], ids=["zero", "negative"])
def test_non_positive_handle_option_is_value_error(option, value):
    with pytest.raises(ValueError, match=option):
        swapio.AioHandle(**{option: value})


@pytest.mark.parametrize("option", ["block_size", "queue_depth", "threads"])
def test_non_int_handle_option_is_type_error(option):
    with pytest.raises(TypeError, match=option):
        swapio.AioHandle(**{option: 4096.0})


@pytest.mark.parametrize("option,value", [("block_size", (1 << 30) + 1), ("queue_depth", 4097), ("threads", 257)])
def test_oversized_handle_option_is_value_error(option, value):
    with pytest.raises(ValueError, match=option):
        swapio.AioHandle(**{option: value})


def test_unknown_engine_is_value_error():
    with pytest.raises(ValueError, match="engine"):
        swapio.AioHandle(engine="bogus")


def test_non_str_engine_is_type_error():
    with pytest.raises(TypeError, match="engine"):
        swapio.AioHandle(engine=1)


def test_non_bool_direct_is_type_error():
    with pytest.raises(TypeError, match="direct"):
        swapio.AioHandle(direct="yes")


@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_closed_handle_is_value_error(tmp_path, op):
    h = swapio.AioHandle()
    h.close()
    assert h.closed
    (tmp_path / "f").write_bytes(b"x" * 16)
    with pytest.raises(ValueError, match="closed"):
        getattr(h, op)(torch.zeros(16, dtype=torch.uint8), tmp_path / "f")
    h.close()  # idempotent


# ---------------------------------------------------------------- OS errors

@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("direct", [None, True, False], ids=lambda d: f"direct{d}")
def test_read_of_missing_file_is_file_not_found(handle_factory, tmp_path, engine, direct):
    h = handle_factory(engine=engine, direct=direct)
    path = tmp_path / "missing.bin"
    with pytest.raises(FileNotFoundError) as info:
        h.pread(torch.empty(10, dtype=torch.uint8), path).wait(timeout=TIMEOUT)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(path)
    assert not path.exists()  # a read never creates the file


def test_write_into_missing_directory_is_file_not_found(handle_factory, tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "f.bin"
    with pytest.raises(FileNotFoundError) as info:
        handle_factory().pwrite(torch.zeros(10), path).wait(timeout=TIMEOUT)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(path)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_write_to_directory_is_is_a_directory_error(handle_factory, tmp_path, engine):
    h = handle_factory(engine=engine)
    with pytest.raises(IsADirectoryError) as info:
        h.pwrite(torch.zeros(10), tmp_path).wait(timeout=TIMEOUT)
    assert info.value.errno == errno.EISDIR
    assert info.value.filename == str(tmp_path)


@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("direct", [None, True, False], ids=lambda d: f"direct{d}")
def test_read_of_directory_is_is_a_directory_error(handle_factory, tmp_path, engine, direct):
    h = handle_factory(engine=engine, direct=direct)
    with pytest.raises(OSError) as info:
        h.pread(torch.empty(10, dtype=torch.uint8), tmp_path).wait(timeout=TIMEOUT)
    assert info.value.filename == str(tmp_path)
    assert info.value.errno == errno.EISDIR, str(info.value)


def test_read_of_directory_gives_no_o_direct_fallback_warning(handle_factory, tmp_path, fresh_warnings):
    """tmp_path's file system takes O_DIRECT; a directory path must not be reported as one that refuses it."""
    h = handle_factory(direct=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OSError):
            h.pread(torch.empty(10, dtype=torch.uint8), tmp_path).wait(timeout=TIMEOUT)
    assert not [w for w in caught if issubclass(w.category, swapio.SwapioWarning)], str(caught[0].message)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
@pytest.mark.parametrize("direct", [None, True, False], ids=lambda d: f"direct{d}")
@pytest.mark.parametrize("file_size,offset,nbytes", [
    (10000, 0, 10001),      # one byte too many
    (10000, 9999, 2),       # starts inside, ends past the end
    (10000, 4096, 8192),    # aligned start, partly past
    (8192, 0, 3 * 4096),    # aligned file size, aligned request, one block past
    (10000, 10000, 1),      # starts exactly at the end
    (10000, 20000, 5000),   # starts beyond the end
    (0, 0, 1),              # empty file
], ids=["one-byte-over", "straddles-end", "aligned-partly-past", "aligned-block-past", "at-end", "beyond-end",
        "empty-file"])
def test_read_past_end_of_file_is_enodata(handle_factory, tmp_path, engine, direct, file_size, offset, nbytes):
    h = handle_factory(engine=engine, direct=direct, block_size=4096)
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(file_size))
    exc = raised(h.pread(torch.empty(nbytes, dtype=torch.uint8), path, offset))
    assert exc.errno == errno.ENODATA
    assert exc.filename == str(path)
    assert isinstance(exc.offset, int) and offset <= exc.offset < offset + nbytes
    assert os.path.getsize(path) == file_size  # reading never grows the file


def test_read_past_end_fails_whole_request_but_reads_in_range_succeed(handle_factory, tmp_path):
    h = handle_factory(block_size=4096, threads=3)
    path = tmp_path / "f.bin"
    content = os.urandom(100000)
    path.write_bytes(content)
    bad = h.pread(torch.empty(100001, dtype=torch.uint8), path)
    good = torch.empty(100000, dtype=torch.uint8)
    ok = h.pread(good, path)
    assert raised(bad).errno == errno.ENODATA
    assert ok.wait(timeout=TIMEOUT) == 100000
    assert good.numpy().tobytes() == content


def test_error_offset_attribute_points_into_the_request(handle_factory, tmp_path):
    h = handle_factory(block_size=4096, direct=False)
    path = tmp_path / "f.bin"
    path.write_bytes(b"z" * (5 * 4096))
    exc = raised(h.pread(torch.empty(10 * 4096, dtype=torch.uint8), path))
    assert exc.errno == errno.ENODATA
    assert 5 * 4096 <= exc.offset < 10 * 4096  # the first piece that ran out
    assert str(path) in str(exc)


def test_zero_length_read_past_end_is_not_an_error(handle_factory, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    assert handle_factory().pread(torch.empty(0), path, 100).wait(timeout=TIMEOUT) == 0


def test_write_to_read_only_mount_is_erofs(handle_factory, readonly_dir):
    h = handle_factory()
    existing = readonly_dir / "existing.bin"
    before = read_file(existing)
    for path in (existing, readonly_dir / "new.bin"):
        with pytest.raises(OSError) as info:
            h.pwrite(random_bytes(100), path).wait(timeout=TIMEOUT)
        assert info.value.errno == errno.EROFS
        assert info.value.filename == str(path)
    assert read_file(existing) == before
    assert not (readonly_dir / "new.bin").exists()
    out = torch.empty(4096, dtype=torch.uint8)
    assert h.pread(out, existing).wait(timeout=TIMEOUT) == 4096  # reading still works
    assert out.numpy().tobytes() == before


_UNPRIVILEGED = textwrap.dedent("""
    import errno, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch, swapio
    h = swapio.AioHandle(engine=sys.argv[3])
    try:
        h.pwrite(torch.zeros(8, dtype=torch.uint8), sys.argv[2]).wait(timeout=60)
    except PermissionError as e:
        print("PermissionError", e.errno, e.filename)
    else:
        print("no error")
""")


@pytest.mark.slow
def test_write_to_read_only_file_without_privileges_is_permission_error(tmp_path):
    """Root ignores file modes, so the write runs in a child that dropped CAP_DAC_OVERRIDE (setpriv)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot drop CAP_DAC_OVERRIDE")
    target = tmp_path / "readonly.bin"
    target.write_bytes(b"keep me")
    target.chmod(0o444)
    cmd = [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", sys.executable, "-c",
           _UNPRIVILEGED, REPO, str(target), "auto"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    if r.returncode != 0:
        pytest.skip(f"cannot run a child without CAP_DAC_OVERRIDE: {r.stderr.strip()[-300:]}")
    assert r.stdout.split() == ["PermissionError", str(errno.EACCES), str(target)]
    assert read_file(target) == b"keep me"


# ---------------------------------------------------------------- timeouts

def test_wait_with_zero_timeout_on_pending_request_raises_timeout_error(handle_factory, tmp_path):
    big, small, out = queued_behind_big_read(handle_factory, tmp_path, 100)
    with pytest.raises(TimeoutError):
        small.wait(timeout=0)
    assert not small.done()
    # The timeout did not disturb the request: it finishes with the right bytes.
    assert big.wait(timeout=TIMEOUT) == 64 << 20
    assert small.wait(timeout=TIMEOUT) == 100
    assert small.done()
    assert out.numpy().tobytes() == b"s" * 100


def test_result_with_short_timeout_raises_timeout_error(handle_factory, tmp_path):
    big, small, _ = queued_behind_big_read(handle_factory, tmp_path)
    with pytest.raises(TimeoutError):
        small.result(timeout=0.0001)
    assert small.result(timeout=TIMEOUT) == 10
    big.wait(timeout=TIMEOUT)


def test_exception_with_zero_timeout_on_pending_request_raises_timeout_error(handle_factory, tmp_path):
    big, small, _ = queued_behind_big_read(handle_factory, tmp_path)
    with pytest.raises(TimeoutError):
        small.exception(timeout=0)
    assert small.exception(timeout=TIMEOUT) is None
    big.wait(timeout=TIMEOUT)


def test_negative_wait_timeout_is_value_error(handle_factory, tmp_path):
    big, small, _ = queued_behind_big_read(handle_factory, tmp_path)
    with pytest.raises(ValueError):
        small.wait(timeout=-1)
    assert small.wait(timeout=TIMEOUT) == 10
    big.wait(timeout=TIMEOUT)


@pytest.mark.parametrize("timeout", [1e10, float("inf")], ids=["1e10s", "inf"])
def test_wait_with_huge_timeout_waits_for_the_result(handle_factory, tmp_path, timeout):
    """A timeout longer than the clock can represent means "no limit", not an immediate TimeoutError."""
    big, small, _ = queued_behind_big_read(handle_factory, tmp_path)
    try:
        assert small.wait(timeout=timeout) == 10
    finally:
        big.wait(timeout=TIMEOUT)


def test_failed_request_raises_the_same_error_on_every_wait(handle_factory, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"q")
    f = handle_factory().pread(torch.empty(2, dtype=torch.uint8), path)
    first = raised(f)
    second = raised(f)
    assert first.errno == second.errno == errno.ENODATA
    assert f.done()
    assert f.exception(timeout=TIMEOUT).errno == errno.ENODATA


@pytest.mark.parametrize("timeout", ["1", b"1", [1]], ids=["str", "bytes", "list"])
def test_non_number_wait_timeout_is_type_error_naming_timeout(handle_factory, tmp_path, timeout):
    big, small, _ = queued_behind_big_read(handle_factory, tmp_path)
    for wait in (small.wait, small.result, small.exception):
        with pytest.raises(TypeError, match="timeout must be None or a number"):
            wait(timeout=timeout)
    assert small.wait(timeout=TIMEOUT) == 10
    big.wait(timeout=TIMEOUT)


@pytest.mark.parametrize("doc", ["[1, 2]", "null", '"psync"', '{"handle": null}', '{"handle": [4096]}'],
                         ids=["list", "null", "str", "handle-null", "handle-list"])
def test_from_config_file_that_is_not_a_settings_object_is_value_error_naming_it(tmp_path, doc):
    cfg = tmp_path / "swapio-io.json"
    cfg.write_text(doc)
    with pytest.raises(ValueError, match="swapio-io.json.*JSON object"):
        swapio.AioHandle.from_config(cfg)


@pytest.mark.parametrize("settings", [None, [4096], "psync"], ids=["None", "list", "str"])
def test_from_config_dict_whose_handle_is_not_a_dict_is_value_error(settings):
    with pytest.raises(ValueError, match="JSON object"):
        swapio.AioHandle.from_config({"handle": settings})


def test_from_config_file_that_is_not_json_is_value_error_naming_it(tmp_path):
    cfg = tmp_path / "swapio-io.json"
    cfg.write_text('{"handle": {"block_size": 4096,')  # cut short
    with pytest.raises(ValueError, match=r"swapio-io.json is not valid JSON"):
        swapio.AioHandle.from_config(cfg)
