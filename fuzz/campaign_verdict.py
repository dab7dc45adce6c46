"""A campaign's per-clause verdict: its targets and failure records as :mod:`magi_moe.verdict`
``Outcome`` records, written as ``verdict.md`` / ``verdict.json`` and printed, as ``magi-moe
check`` and the audit do.

One outcome per target (a property row on one implementation/backend pair or router, or a state
machine on a pair): its clause is the target's (the Property record's ``clause``; a machine's
``clause`` mark), ``failed`` with the first failure record's message and reproduction, ``skipped``
with pytest's reason and its kind (:func:`magi_moe.verdict.skip_kind` of the skip, recorded by
the campaign plugin: an undeclared capability reads NOT DECLARED), with "got no time" when
the budget ended before it started, or "stopped at the hard limit in its first round" when it
started but no round of it finished, else ``passed``. A failure record of no target (a case
that killed its worker, one replayed from the database) is an outcome of its own, under its
property's clause.
"""
from __future__ import annotations

import json
from pathlib import Path

from magi_moe.verdict import Outcome, Status, as_json, markdown, not_run, text_lines, verdict_rows

from .fuzzers import PROPERTIES

__all__ = ["NO_TIME", "campaign_outcomes", "write_verdict"]

NO_TIME = not_run("got no time within the budget (it leads the next campaign)")


def _record_subject(record: dict, backend: str) -> str:
    """``impl@backend`` of a failure (its record's fields, as the summary lists them)."""
    if record.get("router"):
        return f"router {record['router']}@{record.get('backend', backend)}"
    return f"{record.get('impl') or '?'}@{record.get('backend', backend)}"


def _record_clause(failure: dict) -> str:
    prop = PROPERTIES.get(failure.get("property") or "")
    return prop.clause if prop is not None else "other"


def campaign_outcomes(summary: dict, stats: dict[str, dict]) -> list[Outcome]:
    """The campaign's outcomes: ``summary`` as :func:`fuzz.campaign._summary` builds it (or
    :func:`fuzz.merge.merge_summaries`), ``stats`` each target's statistics by node id (its
    ``clause`` and ``subject``; else the summary row's own)."""
    backend = summary.get("backend", "?")
    if isinstance(backend, list):  # a merged summary lists every machine's backend
        backend = ",".join(backend) or "?"
    by_node: dict[str, list[dict]] = {}
    for failure in summary.get("failures", []):
        by_node.setdefault(failure.get("nodeid") or "", []).append(failure)
    outcomes = []
    for row in summary.get("targets", []):
        node = row["target"]
        info = stats.get(node, {})
        subject = info.get("subject") or row.get("subject") or f"{row.get('impl') or '?'}@{backend}"
        clause = info.get("clause") or row.get("clause") or _record_clause(row)
        failures = by_node.pop(node, [])
        if failures:
            first = failures[0]
            outcomes.append(Outcome(subject, clause, Status.FAIL, node, f"{first.get('kind')}: {first.get('message')}",
                                    first.get("repro") or "", cause=first.get("cause")))
        elif row.get("outcome") in ("failed", "error"):
            outcomes.append(Outcome(subject, clause, Status.FAIL, node, row.get("reason") or
                                    f"the test {row['outcome']} (see pytest.log)"))
        elif row.get("outcome") == "skipped":
            outcomes.append(Outcome(subject, clause, Status.SKIP, node, row.get("reason") or "skipped",
                                    kind=row.get("skip_kind")))
        elif row.get("cases", 0) > 0:
            outcomes.append(Outcome(subject, clause, Status.PASS, node,
                                    f"{row['cases']} cases in {row.get('rounds', 0)} rounds"))
        elif row.get("started") is not None and row.get("rounds", 0) == 0:
            outcomes.append(Outcome(subject, clause, Status.SKIP, node, not_run(
                f"stopped at the hard limit in its first round, started {row['started']:.0f} s into "
                f"the campaign (it leads the next campaign)")))
        else:
            outcomes.append(Outcome(subject, clause, Status.SKIP, node, NO_TIME))
    for node, failures in by_node.items():  # records of no target: crashes, database replays
        for failure in failures:
            outcomes.append(Outcome(_record_subject(failure, backend), _record_clause(failure), Status.FAIL,
                                    node, f"{failure.get('kind')}: {failure.get('message')}",
                                    failure.get("repro") or "", cause=failure.get("cause")))
    return outcomes


def write_verdict(out: Path, outcomes: list[Outcome], *, title: str) -> list[str]:
    """Write ``verdict.md`` and ``verdict.json`` under ``out``; returns the console lines."""
    table = verdict_rows(outcomes)
    (out / "verdict.md").write_text(markdown(table, title=title))
    (out / "verdict.json").write_text(json.dumps(as_json(table), indent=1))
    return text_lines(table)
