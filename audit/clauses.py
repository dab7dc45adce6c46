"""The audit's rows as verdict outcomes (:mod:`magi_moe.verdict`): which implementation and which
contract clause each row judges, so the audit ends with the same per-clause table as
``magi-moe check``.

A row's section names its clause (``cache`` rows one ``weight-change/<route>`` clause per route,
``graphs`` rows one ``cuda-graph/<route>``); its subject starts with the implementation's name
(``fused @ small/random``, ``fused: in_place/W_gate``, ``fused.layer()``). ``info`` rows say a
capability is not declared (or, for graphs, that the forward cannot be captured): they count as
skips with that reason. The suite's own checks (backend self-check, mpmath validation of the
bounds, negative controls) are one clause of their own, under the subject ``magi-moe``.
"""
from __future__ import annotations

import shlex
from typing import Iterable

from magi_moe.verdict import Outcome

SUITE = "magi-moe"
SECTION_CLAUSES = {"bounds": "accuracy", "determinism": "determinism", "discipline": "discipline",
                   "compile": "compile", "routing": "routing", "checkpoint": "checkpoint"}
FAMILY_SECTIONS = {"cache": "weight-change", "graphs": "cuda-graph"}
SUITE_SECTIONS = ("selfcheck", "mpcheck", "controls")
_STATUS = {"pass": "passed", "FAIL": "failed", "skip": "skipped", "info": "skipped"}


def _owner(subject: str, names: list[str]) -> str | None:
    """The implementation a subject speaks of: the longest name it starts with, followed by a
    separator (``fused-layer`` is not ``fused``)."""
    for name in sorted(names, key=len, reverse=True):
        if subject == name or subject.startswith((f"{name} ", f"{name}:", f"{name}.", f"{name}@")):
            return name
    return None


def _clause(section: str, subject: str, name: str) -> str | None:
    if section in SECTION_CLAUSES:
        return SECTION_CLAUSES[section]
    if section in FAMILY_SECTIONS:
        rest = subject[len(name):].lstrip(": ")
        route = rest.split("/", 1)[0] if "/" in rest else ""
        return f"{FAMILY_SECTIONS[section]}/{route}" if route else None
    return None


def _info_reason(section: str, result: str) -> str:
    if section == "graphs":
        return f"cannot be captured: {result}"
    if section == "discipline":
        return "does not declare no_host_sync"
    if section == "determinism":
        return "does not declare deterministic"
    return result


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
    """``rows``: the audit's rows (section, subject, status, result, data); ``impls``: each
    audited implementation's name and the spec that names it on the command line; ``backend``:
    the audit's ``--backend``; ``runs_on``: where each implementation really ran (``interpret``
    for Triton kernels audited on the cpu backend), default ``backend``."""
    runs_on = runs_on or {}
    names = list(impls)
    out = []
    for row in rows:
        status = _STATUS.get(row.status)
        if status is None:
            continue
        if row.subject == "section stopped":  # a section raised (Audit.run_section): its clause fails
            clause = SECTION_CLAUSES.get(row.section, "suite-self-check")
            out.append(Outcome(SUITE, clause, "failed", row.section, row.result))
            continue
        if row.section in SUITE_SECTIONS:
            if row.status == "info":  # an observation about the backend, not a judgement
                continue
            out.append(Outcome(SUITE, "suite-self-check", status, row.subject, row.result))
            continue
        name = _owner(row.subject, names)
        clause = None if name is None else _clause(row.section, row.subject, name)
        if clause is None:
            continue
        if row.section == "compile" and name is None:
            continue
        detail = row.result
        if row.status == "info":
            if row.section == "cache":  # "offers no pack count": a note, not a judgement
                continue
            detail = _info_reason(row.section, row.result)
        out.append(Outcome(f"{name}@{runs_on.get(name, backend)}", clause, status, row.subject, detail,
                           repro(backend, impls[name], row.data) if status == "failed" else ""))
    return out
