"""The audit's sections: ``SECTIONS``, run in this order by :class:`audit.report.Audit`.

A section is one :class:`Section` record: its name, what it needs, and ``run(audit)``, a
function of the running :class:`audit.report.Audit` (options, device, selected
implementations, the rows so far) that yields :class:`audit.rows.Row` records. To add one,
write ``run`` in a module here (or beside the section of its topic), yield one row per thing
judged (status ``pass``, ``FAIL``, ``info`` or ``skip``; any ``FAIL`` fails the audit), name the
contract clause its rows judge in :mod:`audit.clauses`, and put its record in ``SECTIONS`` where
its rows should stand in the report. Rows are recorded as they are yielded: should ``run``
raise, the rows it yielded stay and the crash becomes one ``FAIL`` row, "section stopped", under
the section's name; the sections after it and the report still run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from ..rows import Row
from . import accuracy, checkpoint, coverage, cuda, determinism, routing, selfchecks, weight_cache

if TYPE_CHECKING:
    from ..report import Audit


@dataclass(frozen=True)
class Section:
    name: str  # its rows' section (a run may add rows under others: discipline's compile rows)
    run: Callable[[Audit], Iterable[Row]]
    option: str | None = None  # an AuditOptions flag that turns it off when false
    cuda_only: str | None = None  # elsewhere one skip row, "CUDA only", with this subject


SECTIONS: tuple[Section, ...] = (
    Section("selfcheck", selfchecks.selfcheck),
    Section("mpcheck", selfchecks.mp_validation, option="mp_validation"),
    Section("bounds", accuracy.run),
    Section("routing", routing.run),
    Section("controls", selfchecks.controls, option="controls"),
    Section("determinism", determinism.run),
    Section("checkpoint", checkpoint.run),
    Section("cache", weight_cache.run),
    Section("discipline", cuda.discipline, cuda_only="host sync / allocations / compile"),
    Section("graphs", cuda.graphs, cuda_only="CUDA-graph replay"),
    Section("coverage", coverage.run),
)


def section_named(name: str) -> Section:
    for section in SECTIONS:
        if section.name == name:
            return section
    raise ValueError(f"section must be one of {[s.name for s in SECTIONS]}, got {name!r}")
