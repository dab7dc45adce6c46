"""``python -m magi_moe.benchmark``: the older name of ``python -m magi_moe.bench`` (the GPU
scripts call it), kept as an alias of the same command line."""
import sys

from .bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
