"""Command-line parsing shared by ``magi-moe``, ``python -m audit`` and ``python -m fuzz``: a bad
argument is one line on stderr naming the argument and what was expected, and exit status 2,
before any work starts (argparse's own usage block is left to ``--help``)."""
from __future__ import annotations

import argparse
import math
import sys


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse calls this for every refused argument
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def refuse(prog: str, message: str) -> int:
    """Print the one line for a refused argument; returns the exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def finite_positive(text: str) -> float:
    """An argparse type: a finite number > 0 (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def finite_non_negative(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value
