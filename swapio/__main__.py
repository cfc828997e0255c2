"""python -m swapio: the `swapio` command (bench, tune, info)."""
import sys

from .tools.cli import main

sys.exit(main())
