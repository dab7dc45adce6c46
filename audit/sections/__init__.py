"""The audit's sections: ``SECTIONS``, run in this order by :class:`audit.report.Audit`.

A section is one :class:`Section` record: its name, what it needs, and ``run(audit)``, a
function of the running :class:`audit.report.Audit` (options, device, selected
implementations, the rows so far) that yields :class:`audit.rows.Row` records. To add one,
write ``run`` in a module here (or beside the section of its topic), yield one row per thing
judged (status ``pass``, ``FAIL``, ``info`` or ``skip``; any ``FAIL`` fails the audit) naming
the implementation it judges (``impl=impl.name``; the verdict's subject), name the contract
clause its rows judge in its record (``clause=``; rows of several clauses set ``Row.clause``
each), and put its record in ``SECTIONS`` where its rows should stand in the report. A row
without ``impl``, or whose clause is unset, judges no clause (the verdict leaves it out). Rows
are recorded as they are yielded: should ``run`` raise, the rows it yielded stay and the crash
becomes one ``FAIL`` row, "section stopped", under the section's name and clause; the sections
after it and the report still run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from ..rows import Row
from . import accuracy, checkpoint, coverage, cuda, determinism, routing, selfchecks, weight_cache
from . import history
from . import isolation

if TYPE_CHECKING:
    from ..report import Audit


@dataclass(frozen=True)
class Section:
    name: str  # its rows' section (a run may add rows under others: discipline's compile rows)
    run: Callable[[Audit], Iterable[Row]]
    option: str | None = None  # an AuditOptions flag that turns it off when false
    cuda_only: str | None = None  # elsewhere one skip row, "CUDA only", with this subject
    clause: str | None = None  # the clause its rows judge (magi_moe.verdict), unless a row names one


SECTIONS: tuple[Section, ...] = (
    Section("selfcheck", selfchecks.selfcheck, clause="suite-self-check"),
    Section("mpcheck", selfchecks.mp_validation, option="mp_validation", clause="suite-self-check"),
    Section("bounds", accuracy.run, clause="accuracy"),
    Section("routing", routing.run, clause="routing"),
    Section("controls", selfchecks.controls, option="controls", clause="suite-self-check"),
    Section("determinism", determinism.run, clause="determinism"),
    Section("checkpoint", checkpoint.run, clause="checkpoint"),
    Section("isolation", isolation.run, clause="row-isolation"),
    Section("cache", weight_cache.run),  # rows: weight-change/<route>
    Section("history", history.run, clause="history"),
    Section("discipline", cuda.discipline, cuda_only="host sync / allocations / compile",
            clause="discipline"),  # its compile rows: compile
    Section("graphs", cuda.graphs, cuda_only="CUDA-graph replay"),  # rows: cuda-graph/<route>
    Section("coverage", coverage.run),
)


def section_named(name: str) -> Section:
    for section in SECTIONS:
        if section.name == name:
            return section
    raise ValueError(f"section must be one of {[s.name for s in SECTIONS]}, got {name!r}")
