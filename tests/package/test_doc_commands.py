"""The `swapio` commands the README and docs/*.md show work as written: every command line in a shell block
parses with the command's own parser (options renamed or removed since would fail here), every option named
in prose (`swapio plan --ring-bytes R ...`) is one its command has, and the figures docs/cli.md states for its
examples (bytes a parameter, the 70B totals, the demo model's size) are what the command computes."""
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("numpy")  # the `cli` extra
from swapio.tools import cli, demo_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
COMMAND = re.compile(r"swapio (demo|plan|bench|tune|info)\b")


def _shell_lines():
    """[("FILE:LINE", argv)] of each `swapio ...` command line in the docs' non-Python fenced blocks (shell
    transcripts' output lines, such as "swapio bench: sequential ...", are not commands)."""
    out = []
    for doc in DOCS:
        fence = None
        with open(doc) as f:
            for lineno, line in enumerate(f, 1):
                stripped = line.strip()
                if stripped.startswith("```"):
                    fence = None if fence is not None else stripped[3:]
                    continue
                if fence is None or fence == "python":
                    continue
                for part in stripped.split("&&"):
                    if not COMMAND.match(part.strip()):
                        continue
                    command = shlex.split(part, comments=True)
                    if len(command) > 1 and command[0] == "swapio" and not command[1].endswith(":"):
                        out.append((f"{os.path.relpath(doc, REPO)}:{lineno}", command[1:]))
    return out


def _prose_options():
    """[("FILE", subcommand, option)] of each --option in an inline `swapio <command> ...` span (not in a quoted
    message, "swapio bench: error: ...")."""
    out = []
    for doc in DOCS:
        with open(doc) as f:
            text = f.read()
        for span in re.findall(r"`(swapio (?:demo|plan|bench|tune|info)\b(?!:)[^`]*)`", text):
            command = span.split()[1]
            out += [(os.path.relpath(doc, REPO), command, o) for o in re.findall(r"(--[\w-]+)", span)]
    return out


def _options(command):
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings}


def test_the_docs_show_commands():
    assert len(_shell_lines()) >= 10 and len(_prose_options()) >= 10


@pytest.mark.parametrize("where, argv", _shell_lines(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_command_line_in_the_docs_parses(where, argv):
    args = cli.build_parser().parse_args(argv)  # a UsageError (exit 2) names the option it refuses
    assert args.command == argv[0]


def test_every_option_the_prose_names_exists():
    unknown = [f"{doc}: swapio {command} {option}" for doc, command, option in _prose_options()
               if option not in _options(command)]
    assert not unknown, unknown


def test_plan_gives_cli_md_figures_for_its_example():
    """docs/cli.md: "Adam on fp16 weights is thus 2 + 2 + 12 = 16 bytes a parameter; 70B parameters take 130.4
    GiB of weights and 782.3 GiB of state" (from `swapio plan --params 70B --dtype fp16 --optimizer adam --json`)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "swapio", "plan", "--params", "70B", "--dtype", "fp16", "--optimizer",
                        "adam", "--json", "--ram", "64G", "--gpu-mem", "24G"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    numbers = json.loads(r.stdout)
    with open(os.path.join(REPO, "docs", "cli.md")) as f:
        doc = f.read()
    assert "2 + 2 + 12 = 16 bytes a parameter" in doc and "130.4 GiB of weights and 782.3 GiB of state" in doc
    per_param = numbers["bytes_per_param"]
    assert (per_param["weights"], per_param["grads"], per_param["optimizer_state"], per_param["total"]) == (2, 2, 12, 16)
    assert f'{numbers["totals"]["weights"] / 2**30:.1f}' == "130.4"
    assert f'{numbers["totals"]["optimizer_state"] / 2**30:.1f}' == "782.3"


def test_the_demo_model_has_the_size_cli_md_states():
    """docs/cli.md: `swapio demo` runs "80 steps of a 0.37 M-parameter byte-level GPT" with its defaults."""
    args = cli.build_parser().parse_args(["demo"])
    model = demo_model.TinyGPT(args.layers, args.width, args.heads, args.context)
    assert args.steps == 80
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == 0.37


def test_the_examples_in_the_commands_help_parse():
    """`swapio <command> --help` examples (bench's epilog) are command lines too."""
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    examples = [re.split(r"\s{2,}", line.strip())[0] for sub in subs.values() for line in (sub.epilog or "").splitlines()
                if COMMAND.match(line.strip())]
    assert examples
    for line in examples:
        argv = shlex.split(line)[1:]
        assert cli.build_parser().parse_args(argv).command == argv[0], line
