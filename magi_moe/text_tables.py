"""Plain-text tables for the command-line reports (audit summary, benchmark, ``fuzz list``).

Cells are never cut: two rows whose names share a long prefix must still read differently.
``tabulate`` draws the table where it is installed (the ``audit``, ``fuzz`` and ``test`` extras
bring it); GPU images that only have the test tools get the same columns, padded by hand.
"""
from __future__ import annotations

from typing import Sequence

try:
    from tabulate import tabulate as _tabulate
except ImportError:  # the GPU image: nothing installed beyond torch, triton and the test tools
    _tabulate = None

__all__ = ["format_table"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 numeric_columns: Sequence[int] = ()) -> str:
    """``rows`` under ``headers`` as aligned text; cells are shown whole (``str`` of each value).
    Columns listed in ``numeric_columns`` are right-aligned, the others left-aligned."""
    width = len(headers)
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"row {i} has {len(row)} cells, expected {width} (one per header)")
    cells = [["" if c is None else str(c) for c in row] for row in rows]
    align = ["right" if i in numeric_columns else "left" for i in range(width)]
    if _tabulate is not None:
        # disable_numparse: cells are already formatted; tabulate must not reformat "2.38e-03".
        return _tabulate(cells, headers=list(headers), tablefmt="simple", colalign=align,
                         disable_numparse=True)
    return _plain(list(headers), cells, align)


def _plain(headers: list[str], cells: list[list[str]], align: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if a == "right" else v.ljust(w)
                         for v, w, a in zip(values, widths, align)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])
