"""The audit's rows as verdict outcomes (:mod:`magi_moe.verdict`), so the audit ends with the
same per-clause table as ``magi-moe check``.

Every fact comes from the row as data (:class:`audit.rows.Row`): ``impl`` and ``backend`` (the
subject ``impl@backend``; the suite's own checks are the subject ``magi-moe``), ``clause`` (set
by the row's section, :mod:`audit.sections`), ``status``, and for an ``info`` row that stands
for a case not judged, ``skip`` (its reason and kind). A row without an implementation or a
clause judges no clause; an ``info`` row without ``skip`` is a note.
"""
from __future__ import annotations

import shlex
from typing import Iterable

from magi_moe.verdict import Outcome, Status

from .rows import SUITE


def repro(backend: str, spec: str, data: dict) -> str:
    """The audit narrowed to the failing implementation (and the failing preset and probe)."""
    parts = ["magi-moe", "audit", "--backend", backend, "--impl", spec]
    preset = str(data.get("preset", "")).split("(")[0]
    if preset:
        parts += ["--preset", preset]
    if data.get("probe"):
        parts += ["--probe", str(data["probe"])]
    return " ".join(shlex.quote(p) for p in parts)


def audit_outcomes(rows: Iterable, *, impls: dict[str, str], backend: str,
                   runs_on: dict[str, str] | None = None) -> list[Outcome]:
    """``rows``: the audit's rows; ``impls``: each audited implementation's name and the spec
    that names it on the command line (for the rerun command); ``backend``: the audit's
    ``--backend``; ``runs_on``: where each implementation really ran, for rows whose
    ``backend`` is not set (``interpret`` for Triton kernels audited on the cpu backend),
    default ``backend``."""
    runs_on = runs_on or {}
    out = []
    for row in rows:
        if row.impl is None or row.clause is None:
            continue
        status = Status(row.status)
        if status is Status.INFO:
            if row.skip is None:  # an observation, not a judgement
                continue
            status = Status.SKIP
        detail = row.skip if status is Status.SKIP and row.skip is not None else row.result
        if row.impl == SUITE:
            out.append(Outcome(SUITE, row.clause, status, row.subject, detail))
            continue
        where = row.backend or runs_on.get(row.impl, backend)
        out.append(Outcome(f"{row.impl}@{where}", row.clause, status, row.subject, detail,
                           repro(backend, impls.get(row.impl, row.impl), row.data)
                           if status is Status.FAIL else "", cause=row.cause))
    return out
