"""Hostile memory and paths: read-only destinations, shrunk storages, FIFOs and other non-files, impossible
pinned sizes. Each is a clear Python exception, never a crash or a hang."""
import errno
import os
import socket
import warnings

import numpy as np
import pytest
import torch

import swapio
from conftest import ENGINE_PARAMS, MiB, TIMEOUT, random_bytes


@pytest.fixture
def source_file(tmp_path):
    path = tmp_path / "src.bin"
    path.write_bytes(random_bytes(MiB, 1).numpy().tobytes())
    return path


def readonly_tensor(tmp_path, nbytes):
    """A tensor over a read-only np.memmap: torch sees no flag, but its pages cannot be written."""
    np.zeros(nbytes, np.uint8).tofile(tmp_path / "ro.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "The given NumPy array is not writable"
        return torch.from_numpy(np.memmap(tmp_path / "ro.bin", mode="r", dtype=np.uint8))


@pytest.mark.parametrize("shift", [0, 1], ids=["page-aligned", "misaligned"])
@pytest.mark.parametrize("engine", ENGINE_PARAMS)
def test_pread_into_readonly_mapping_is_efault(handle_factory, tmp_path, source_file, engine, shift):
    # Aligned: the kernel refuses the O_DIRECT transfer. Misaligned: a bounce copy would have crashed.
    dst = readonly_tensor(tmp_path, MiB)[shift:shift + (256 << 10)]
    h = handle_factory(engine=engine)
    with pytest.raises(OSError, match="not writable") as info:
        h.pread(dst, source_file, offset=4096).wait(timeout=TIMEOUT)
    assert info.value.errno == errno.EFAULT and info.value.filename == str(source_file)
    assert not dst.any()  # nothing was written into the read-only pages
    back = torch.empty(4096, dtype=torch.uint8)  # and the handle still works
    assert h.pread(back, source_file).wait(timeout=TIMEOUT) == 4096


def test_pwrite_from_readonly_mapping_works(handle_factory, tmp_path):
    src = readonly_tensor(tmp_path, MiB)[1:]
    assert handle_factory().pwrite(src, tmp_path / "out.bin").wait(timeout=TIMEOUT) == src.nbytes
    assert (tmp_path / "out.bin").read_bytes() == bytes(src.nbytes)


@pytest.mark.parametrize("new_size", [0, 4096], ids=["emptied", "shrunk"])
@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_tensor_over_shrunk_storage_is_value_error(handle_factory, source_file, op, new_size):
    t = torch.empty(MiB, dtype=torch.uint8)
    t.untyped_storage().resize_(new_size)
    with pytest.raises(ValueError, match="storage holds only"):
        getattr(handle_factory(), op)(t, source_file)


def test_view_at_the_end_of_its_storage_is_accepted(handle_factory, source_file):
    base = torch.empty(2 * 4096, dtype=torch.uint8)
    view = base[4096:]
    assert handle_factory().pread(view, source_file).wait(timeout=TIMEOUT) == 4096
    assert view.numpy().tobytes() == source_file.read_bytes()[:4096]


def make_fifo(path):
    os.mkfifo(path)
    return path


def make_socket(path):
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return path


@pytest.mark.parametrize("make, kind", [(make_fifo, "a FIFO"), (make_socket, "a socket"),
                                        (lambda p: "/dev/zero", "a character device")],
                         ids=["fifo", "socket", "chardev"])
@pytest.mark.parametrize("op", ["pread", "pwrite"])
def test_non_file_paths_are_refused_without_blocking(handle_factory, tmp_path, op, make, kind):
    path = make(tmp_path / "special")
    with pytest.raises(OSError, match=f"it is {kind}, not a regular file") as info:
        getattr(handle_factory(), op)(torch.zeros(4096, dtype=torch.uint8), path, offset=8192)
    assert info.value.errno == errno.EINVAL and info.value.filename == str(path)
    assert info.value.offset == 8192


def test_open_failure_names_the_requests_offset(handle_factory, tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        handle_factory().pread(torch.empty(10), tmp_path / "missing.bin", offset=4096)
    assert info.value.offset == 4096 and "(offset 4096)" in str(info.value)


@pytest.mark.parametrize("shape", [(2 ** 62,), (2 ** 40, 2 ** 30)], ids=["2**62", "2**70"])
def test_empty_pinned_beyond_the_address_space_is_value_error(shape):
    with pytest.raises(ValueError, match="more than this machine can address"):
        swapio.empty_pinned(shape)
