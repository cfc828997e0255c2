"""`swapio info`: readable text and JSON."""
import json
import resource

import pytest

from helpers.cli import assert_one_line_error, run_cli


def test_info_text_names_every_engine_and_the_path(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "info", "--path", str(tmp_path))
    assert rc == 0, err
    for word in ("I/O engines", "uring", "aio", "psync", "O_DIRECT", "SIMD", "CUDA", str(tmp_path)):
        assert word in out


def test_info_json_is_swapio_info(capsys, tmp_path):
    rc, out, _ = run_cli(capsys, "info", "--json", "--path", str(tmp_path))
    assert rc == 0
    data = json.loads(out)
    assert set(data["engines"]) >= {"uring", "aio", "psync"}
    assert isinstance(data["path"]["direct"], bool)


def test_info_missing_path_is_one_line_error(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "info", "--path", str(tmp_path / "nope"))
    assert_one_line_error(rc, err, "does not exist")


def _has_cap_ipc_lock():
    with open("/proc/self/status") as f:
        cap_eff = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(cap_eff.split()[1], 16) & (1 << 14))


def test_info_says_when_the_memlock_limit_does_not_apply(capsys):
    # As root, `swapio info` printed "memlock limit 8 MiB" although CAP_IPC_LOCK lets mlock go past ulimit -l.
    rc, out, _ = run_cli(capsys, "info")
    assert rc == 0
    line = next(line for line in out.splitlines() if line.startswith("memlock limit"))
    if resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY:  # no limit to lift
        assert line.split()[2] == "unlimited"
    elif _has_cap_ipc_lock():
        assert "CAP_IPC_LOCK" in line and line.split()[2] == "none"
    else:
        assert "CAP_IPC_LOCK" not in line


@pytest.mark.parametrize("cap_eff, expected", [("000001fffeffffff", True), ("0000000000004000", True),
                                               ("0000000000000000", False), ("000001fffeffbfff", False)])
def test_cap_ipc_lock_reads_bit_14_of_the_effective_set(cap_eff, expected):
    from swapio.info import cap_ipc_lock
    status = f"Name:\tpython\nCapInh:\t0000000000000000\nCapPrm:\t{cap_eff}\nCapEff:\t{cap_eff}\n"
    assert cap_ipc_lock(status) is expected


def test_info_text_with_and_without_the_capability():
    from swapio.info import info
    from swapio.tools.info_text import info_text
    data = dict(info(), memlock_limit=8 << 20)
    assert "8 MiB (ulimit -l" in info_text(dict(data, cap_ipc_lock=False))
    text = info_text(dict(data, cap_ipc_lock=True))
    assert "CAP_IPC_LOCK" in text and "(8 MiB)" in text
    assert "unlimited" in info_text(dict(data, memlock_limit=None))
