"""swapio.info(): which keys it reports and their types, with and without a path."""
import os

import pytest

import swapio

ENGINE_NAMES = {"uring", "aio", "psync", "null"}


def test_info_top_level_keys_and_types():
    i = swapio.info()
    assert i["version"] == swapio.__version__ and isinstance(i["version"], str)
    assert set(i["engines"]) == ENGINE_NAMES
    assert all(isinstance(v, str) for v in i["engines"].values())
    assert i["auto_engine"] in {"uring", "aio", "psync"}
    assert i["engines"][i["auto_engine"]] == "ok"
    assert i["adam_simd"] is None or isinstance(i["adam_simd"], str)
    assert isinstance(i["threads"], int) and i["threads"] >= 1
    assert isinstance(i["cpu_count"], int) and i["cpu_count"] >= 1
    assert isinstance(i["cuda_pinning"], bool)
    assert i["memlock_limit"] is None or isinstance(i["memlock_limit"], int)
    for key in ("torch", "python", "kernel"):
        assert isinstance(i[key], str) and i[key]
    assert "path" not in i


def test_info_engine_status_is_ok_or_a_reason():
    for name, status in swapio.info()["engines"].items():
        assert status == "ok" or len(status) > 3, f"{name}: {status!r}"
    assert swapio.info()["engines"]["null"] == "ok"


def test_info_of_directory_reports_o_direct_and_alignment(tmp_path):
    p = swapio.info(tmp_path)["path"]
    assert p["path"] == str(tmp_path)
    assert isinstance(p["direct"], bool)
    assert isinstance(p["mem_align"], int) and isinstance(p["offset_align"], int)
    assert isinstance(p["alignment_from_statx"], bool)
    if p["direct"]:
        for key in ("mem_align", "offset_align"):
            assert p[key] > 0 and p[key] & (p[key] - 1) == 0  # a power of two
    assert os.listdir(tmp_path) == []  # the probe file is cleaned up


def test_info_of_dot_uses_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert swapio.info(".")["path"]["path"] == str(tmp_path)


def test_info_of_existing_file_probes_that_file(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 10)
    p = swapio.info(str(f))["path"]
    assert p["path"] == str(f) and isinstance(p["direct"], bool)
    assert f.read_bytes() == b"x" * 10


def test_info_auto_engine_follows_swapio_engine_variable(monkeypatch):
    monkeypatch.setenv("SWAPIO_ENGINE", "psync")
    assert swapio.info()["auto_engine"] == "psync"


@pytest.mark.parametrize("value", ["bogus", "io_uring", "URING"])
def test_an_unknown_swapio_engine_is_named_as_the_variable(monkeypatch, value):
    """SWAPIO_ENGINE=bogus failed as "unknown engine 'bogus'", pointing at an engine= nobody passed, and info()
    reported 'bogus' as auto's pick. An engine passed by name does not read the variable."""
    monkeypatch.setenv("SWAPIO_ENGINE", value)
    expected = rf"SWAPIO_ENGINE='{value}' names no engine \(set it to one of uring, aio, psync, null, or unset it\)"
    with pytest.raises(ValueError, match=expected):
        swapio.AioHandle()
    with pytest.raises(ValueError, match=expected):
        swapio.info()
    with swapio.AioHandle(engine="psync") as h:
        assert h.engine == "psync"


@pytest.mark.parametrize("value", ["", "auto"])
def test_an_empty_or_auto_swapio_engine_lets_auto_choose(monkeypatch, value):
    monkeypatch.delenv("SWAPIO_ENGINE", raising=False)
    unset = swapio.info()["auto_engine"]
    monkeypatch.setenv("SWAPIO_ENGINE", value)
    assert swapio.info()["auto_engine"] == unset
    with swapio.AioHandle() as h:
        assert h.engine == unset


def test_public_names_exist():
    for name in ("AioHandle", "Future", "SwapStore", "SwappedTensor", "SwapioWarning", "empty_pinned", "info",
                 "is_pinned", "__version__"):
        assert hasattr(swapio, name), name
    assert issubclass(swapio.SwapioWarning, Warning)


@pytest.mark.parametrize("missing", ["does/not/exist"])
def test_info_of_missing_path_raises_os_error(tmp_path, missing):
    with pytest.raises(OSError):
        swapio.info(tmp_path / missing)


def test_native_registry_is_what_the_handle_and_info_use():
    from swapio import _C
    assert tuple(swapio.info()["engines"]) == _C.ENGINES
    assert set(_C.AUTO_ENGINE_ORDER) < set(_C.ENGINES) and "null" not in _C.AUTO_ENGINE_ORDER
    assert swapio.info()["auto_engine"] == swapio.AioHandle(queue_depth=1).engine
    for name, limit in (("block_size", _C.MAX_BLOCK_SIZE), ("queue_depth", _C.MAX_QUEUE_DEPTH),
                        ("threads", _C.MAX_THREADS)):
        with pytest.raises(ValueError, match=f"{name} must be between 1 and"):
            swapio.AioHandle(engine="null", **{name: limit + 1})
    swapio.AioHandle(block_size=_C.MAX_BLOCK_SIZE, queue_depth=_C.MAX_QUEUE_DEPTH, engine="null").close()


def test_engine_traits_in_the_registry_match_what_the_engines_do(tmp_path):
    """swapio._C.DATA_ENGINES (what bench --verify and info read) names exactly the engines whose writes land."""
    import torch
    from swapio import _C
    data = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
    for name, status in swapio.info()["engines"].items():
        if status != "ok":
            continue
        path = tmp_path / name
        path.write_bytes(bytes(data.numel()))
        with swapio.AioHandle(block_size=4096, queue_depth=8, engine=name) as h:
            h.pwrite(data, str(path)).wait()
        landed = path.read_bytes() == data.numpy().tobytes()
        assert landed == (name in _C.DATA_ENGINES), name
    assert set(_C.SYNC_ENGINES) <= set(_C.ENGINES) and set(_C.DATA_ENGINES) <= set(_C.ENGINES)
