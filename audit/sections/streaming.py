"""Rows from an auditor that reports its results through a callback (``on_result``)."""
from __future__ import annotations

from typing import Callable, Generator

from ..rows import Row


def rows_as_found(audit_call: Callable, to_row: Callable) -> Generator[Row, None, object]:
    """Run ``audit_call(on_result)``, yield ``to_row(result)`` for each result it reported, and
    return what it returned (``report = yield from rows_as_found(...)``). Should it raise, the
    rows found before are yielded first: the report keeps them, then the section's FAIL row."""
    found: list = []
    crash = None
    try:
        returned = audit_call(found.append)
    except Exception as exc:  # noqa: BLE001 -- raised again below, after its rows
        crash, returned = exc, None
    yield from map(to_row, found)
    if crash is not None:
        raise crash
    return returned
