"""The audit's unit of result: a :class:`Row` (section, subject, status, result, data) and its
four statuses. Sections (:mod:`audit.sections`) yield rows; :mod:`audit.report` prints, keeps
and writes them."""
from __future__ import annotations

from dataclasses import dataclass, field

PASS, FAIL, INFO, SKIP = "pass", "FAIL", "info", "skip"


@dataclass
class Row:
    section: str
    subject: str
    status: str
    result: str
    data: dict = field(default_factory=dict)
