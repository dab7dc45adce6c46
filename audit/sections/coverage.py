"""The ``coverage`` section, last: which implementations under test were audited at all. An
audit in which none ran (or an asked-for one never ran) audited nothing, and says why; its
``skip`` rows make the exit status 3 (:attr:`audit.report.Audit.vacuous`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from magi_moe.impls import BASELINE, REFERENCE

from ..rows import FAIL, INFO, PASS, SKIP, Row

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "coverage"


def run(audit: Audit) -> Iterator[Row]:
    bounds = [r for r in audit.rows if r.section == "bounds"]
    ran = {r.subject.split(" @ ")[0] for r in bounds if r.status in (PASS, FAIL)}
    oracles = {REFERENCE.name, BASELINE.name}
    asked = audit.selected_impls() if audit.options.impls else [
        i for i in audit.selected_impls() if i.name not in oracles]
    skipped = {r.subject.split(" @ ")[0]: r.result for r in bounds if r.status == SKIP}
    missing = [i for i in asked if i.name not in ran]
    if audit.options.impls:
        for impl in asked:
            if impl.name in ran:
                yield Row(SECTION, impl.name, PASS, "audited")
    elif ran - oracles:
        yield Row(SECTION, "implementations under test", PASS,
                  f"audited: {', '.join(sorted(ran - oracles))}")
    if missing and (audit.options.impls or not (ran - oracles)):
        status = INFO if audit.options.allow_no_kernels else SKIP
        for impl in missing:
            yield Row(SECTION, impl.name, status,
                      f"NOT AUDITED: {skipped.get(impl.name, 'no bound check ran')}")
