"""Scratch files swapio makes in a user's directory (swapio.info's O_DIRECT probe, the swapio command's writability
check and its bench/tune file) have no name there: a process killed while it holds one (SIGKILL, the OOM killer)
leaves nothing behind. Before, a probe killed mid-way left a `.swapio-probe-*` file for good."""
import errno
import os
import signal
import subprocess
import sys

import pytest

import swapio
from swapio.core import _unnamed_file
from swapio.tools.testfile import TestFile, creation_refused

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KILLED_IN_PROBE = """
import os, sys
import swapio
info_module = sys.modules["swapio.info"]


class KilledInProbe:  # the native core, but the process dies inside the O_DIRECT probe
    def __getattr__(self, name):
        return getattr(swapio._C, name)

    @staticmethod
    def probe_file(path):
        os.kill(os.getpid(), 9)


info_module._C = KilledInProbe()
swapio.info(sys.argv[1])
"""


def test_a_process_killed_inside_the_probe_leaves_nothing(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", KILLED_IN_PROBE, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert os.listdir(tmp_path) == []


@pytest.fixture(params=["O_TMPFILE", "without O_TMPFILE"])
def file_system(request, monkeypatch):
    """Where the file system has no O_TMPFILE (NFS, some FUSE), the file is named for a moment only."""
    if request.param != "O_TMPFILE":
        real = os.open

        def no_tmpfile(path, flags, *args, **kwargs):
            if flags & os.O_TMPFILE == os.O_TMPFILE:
                raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP), path)
            return real(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", no_tmpfile)
    return request.param


def test_the_probe_gives_the_same_answer_from_an_unnamed_file(tmp_path, file_system, monkeypatch):
    named = tmp_path / "named"
    named.write_bytes(b"\0" * 4096)
    want = swapio.info(str(named))["path"]  # a file is probed as it is
    seen = []
    real = sys.modules["swapio.info"]._C

    class Watching:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def probe_file(path):
            seen.append(sorted(os.listdir(tmp_path)))
            return real.probe_file(path)

    monkeypatch.setattr(sys.modules["swapio.info"], "_C", Watching())
    got = swapio.info(str(tmp_path))["path"]
    assert seen == [["named"]]  # nothing but the user's file, while the probe ran
    keys = ("direct", "mem_align", "offset_align")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert sorted(os.listdir(tmp_path)) == ["named"]


def test_the_writability_check_and_the_bench_file(tmp_path, file_system):
    assert creation_refused(str(tmp_path)) is None
    assert "creating a file there" in creation_refused("/proc")
    target = TestFile(directory=str(tmp_path))
    with open(target.path, "r+b") as f:  # the path opens the file, in the directory, with no name
        f.write(b"swapio")
    assert target.current_size() == 6 and os.listdir(tmp_path) == []
    assert os.stat(target.path).st_dev == os.stat(tmp_path).st_dev
    fd = target._scratch.fd
    target.finish(failed=False)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed: the file is gone with it
    assert os.listdir(tmp_path) == []


def test_a_directory_that_refuses_files_raises_as_creating_one_would(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError):
        _unnamed_file.open_unnamed(str(missing))
    with pytest.raises(OSError) as e:
        _unnamed_file.open_unnamed("/proc")
    assert e.value.errno in (errno.EACCES, errno.ENOENT, errno.EPERM, errno.EROFS)


@pytest.fixture(params=["no /proc", "another PID namespace's /proc"])
def proc_not_reaching(request, monkeypatch, tmp_path_factory):
    """/proc/<pid>/fd/<n> missing (not mounted, some chroots), or opening another process's file. Before, the
    bench, tune and info(dir) failed on that path (or would have worked on a stranger's file)."""
    stranger = tmp_path_factory.mktemp("stranger") / "file"
    stranger.write_bytes(b"not ours")
    missing = str(tmp_path_factory.mktemp("empty") / "proc-not-mounted")
    wrong = missing if request.param == "no /proc" else str(stranger)
    monkeypatch.setattr(_unnamed_file, "path_of", lambda fd: wrong)
    return stranger


def test_without_proc_a_scratch_file_is_named_until_closed(tmp_path, proc_not_reaching):
    scratch = _unnamed_file.ScratchFile(tmp_path)
    assert scratch.name and os.path.dirname(scratch.name) == str(tmp_path)
    assert os.listdir(tmp_path) == [os.path.basename(scratch.name)]
    assert os.path.basename(scratch.name).startswith(".swapio-scratch-")
    with open(scratch.path, "r+b") as f:  # the path opens the file of fd
        f.write(b"swapio")
    assert os.pread(scratch.fd, 6, 0) == b"swapio"
    scratch.close()
    scratch.close()  # a second close does nothing
    assert os.listdir(tmp_path) == []
    assert proc_not_reaching.read_bytes() == b"not ours"


def test_without_proc_bench_file_and_probe_work_and_leave_nothing(tmp_path, proc_not_reaching):
    named = tmp_path / "named"
    named.write_bytes(b"\0" * 4096)
    want = swapio.info(str(named))
    got = swapio.info(str(tmp_path))
    keys = ("direct", "mem_align", "offset_align")
    assert {k: got["path"][k] for k in keys} == {k: want["path"][k] for k in keys}
    target = TestFile(directory=str(tmp_path))
    assert target.shown == target.path and os.path.exists(target.path)
    with open(target.path, "r+b") as f:
        f.write(b"swapio")
    assert target.current_size() == 6
    target.finish(failed=False)
    assert sorted(os.listdir(tmp_path)) == ["named"]
    assert proc_not_reaching.read_bytes() == b"not ours"


def test_a_ctrl_c_while_the_named_scratch_file_is_made_leaves_nothing(tmp_path, proc_not_reaching, monkeypatch):
    """A Ctrl-C held off while the named file is made lands as that ends: it came out of ScratchFile() itself,
    so no caller ever had the file to close, and the `.swapio-scratch-*` file (and its descriptor) stayed."""
    real = _unnamed_file.tempfile.mkstemp
    made = []

    def interrupted(*args, **kwargs):
        made.append(real(*args, **kwargs))
        signal.raise_signal(signal.SIGINT)  # (held off until the name is known)
        return made[-1]
    monkeypatch.setattr(_unnamed_file.tempfile, "mkstemp", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _unnamed_file.ScratchFile(tmp_path)
    assert made and os.listdir(tmp_path) == []
    with pytest.raises(OSError):
        os.fstat(made[0][0])  # closed
