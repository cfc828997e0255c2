"""python -m swapio: the `swapio` command (demo, plan, bench, tune, info)."""
import sys

from .tools.entry import main

sys.exit(main())
