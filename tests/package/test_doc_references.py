"""What the docs point at exists: every repository path the README, docs/*.md, the library, the tests and the
benchmarks name (swapio/..., tests/..., benchmarks/..., examples/..., csrc/..., docs/...) is a file of the
checkout, and docs/design.md's source map names every module of swapio/. Files move (the tests went into
folders, modules into packages); a reader following a stale path finds nothing."""
import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = re.compile(r"(?:(?<=\.\./)|(?<![\w./-]))((?:swapio|tests|benchmarks|examples|csrc|docs)/[\w./-]*\w"
                  r"\.(?:py|pyi|md|sh|cpp|h|txt|toml|json))\b")


def _texts():
    names = [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
    for folder in ("swapio", "tests", "benchmarks", "examples"):
        names += sorted(glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True))
    return [n for n in names if n != os.path.abspath(__file__)]  # (this file's examples name no file on purpose)


def test_every_repository_path_named_in_docs_and_code_exists():
    missing = []
    for name in _texts():
        with open(name) as f:
            text = f.read()
        for m in PATH.finditer(text):
            if not os.path.exists(os.path.join(REPO, m.group(1))):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{os.path.relpath(name, REPO)}:{line}: {m.group(1)}")
    assert not missing, "paths that name no file of the checkout:\n" + "\n".join(missing)


def test_the_scan_sees_a_stale_path(tmp_path):
    """The pattern finds paths in prose, backticks and links, and leaves URLs and other trees alone."""
    text = ("see `swapio/_durable.py`, (tests/test_x.py) and [r](../benchmarks/RESULTS.md); "
            "not https://example.org/swapio/x.py nor /usr/lib/swapio/y.py")
    assert [m.group(1) for m in PATH.finditer(text)] == ["swapio/_durable.py", "tests/test_x.py",
                                                         "benchmarks/RESULTS.md"]


def test_the_design_source_map_names_every_module():
    with open(os.path.join(REPO, "docs", "design.md")) as f:
        design = f.read()
    modules = [os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "swapio", "**", "*.py"),
                                                           recursive=True)]
    unnamed = sorted(m for m in modules
                     if os.path.basename(m) != "__init__.py" and not re.search(
                         r"(?<![\w.])" + re.escape(os.path.basename(m)) + r"\b", design))
    assert not unnamed, f"docs/design.md's source map does not name {unnamed}"
