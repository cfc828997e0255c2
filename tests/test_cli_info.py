"""`swapio info`: readable text and JSON."""
import json

from _cli_helpers import assert_one_line_error, run_cli


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
