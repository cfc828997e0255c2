"""The `swapio` script's entry point: checks that the command's extras are installed before importing the
command, so a plain `pip install swapio` (the library alone) gets one line saying what to install, not a
traceback from deep inside an import."""
import importlib.util
import sys
from typing import List, Optional

from .._interrupt import interrupted

CLI_EXTRAS = ("numpy", "tqdm")  # pyproject.toml's [cli] extra


def missing_extras() -> List[str]:
    return [name for name in CLI_EXTRAS if importlib.util.find_spec(name) is None]


def main(argv: Optional[List[str]] = None) -> int:
    try:  # Ctrl-C while the command's modules (numpy among them) load, or one cli.main lets out: one line
        missing = missing_extras()
        if missing:
            print(f"swapio: the swapio command needs {', '.join(missing)}, which the library alone does not "
                  "install: pip install 'swapio[cli]'", file=sys.stderr)
            return 1
        from .cli import main as cli_main
        return cli_main(argv)
    except KeyboardInterrupt:
        return interrupted()
