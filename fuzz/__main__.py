"""``python -m fuzz`` (in a checkout) and ``python -m magi_moe.fuzz``: the fuzz campaign's command
line, :mod:`magi_moe.fuzz.cli`, loaded under its one name."""
import sys

from magi_moe.fuzz.cli import main

if __name__ == "__main__":
    sys.exit(main())
