"""``python -m audit`` (in a checkout) and ``python -m magi_moe.audit``: the audit's command
line, :mod:`magi_moe.audit.cli`, loaded under its one name."""
import sys

from magi_moe.audit.cli import cli

if __name__ == "__main__":
    sys.exit(cli())
