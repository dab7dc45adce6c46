"""The audit's unit of result: a :class:`Row` (section, subject, status, result, data) and what
the verdict needs of it as data: the implementation it judges and the contract clause. Sections
(:mod:`audit.sections`) yield rows; :mod:`audit.report` prints, keeps and writes them.

The statuses are the verdict's case statuses (:class:`magi_moe.verdict.Status`): ``pass``,
``FAIL``, ``skip`` and ``info``, an observation that judges nothing unless it carries a
:class:`~magi_moe.verdict.SkipReason` in ``skip`` (a capability not declared, say)."""
from __future__ import annotations

from dataclasses import dataclass, field

from magi_moe.verdict import SkipReason, Status

PASS, FAIL, INFO, SKIP = Status.PASS, Status.FAIL, Status.INFO, Status.SKIP
SUITE = "magi-moe"  # the impl of the suite's own checks (self-check, mpmath, negative controls)


@dataclass
class Row:
    section: str
    subject: str
    status: str
    result: str
    data: dict = field(default_factory=dict)
    impl: str | None = None  # the implementation judged (its name), SUITE, or None: no verdict case
    clause: str | None = None  # the clause judged; None: its Section's (audit.sections)
    skip: SkipReason | None = None  # an info row that stands for a case not judged: why, its kind
    backend: str | None = None  # where impl ran; None: filled in by Audit.record
    cause: str | None = None  # a FAIL's root cause when not its clause's own (magi_moe.verdict.CAUSES)
