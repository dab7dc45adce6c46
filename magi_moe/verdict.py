"""The verdict: one row per contract clause and implementation, from whatever judged it.

``magi-moe check`` / ``pytest --conformance`` (through magi-moe's pytest plugin) and the audit
(``audit.report``) report the cases they ran as :class:`Outcome` records, each naming its clause
(:func:`clauses`, the one registry: adding a clause is one :class:`Clause` record there).
:func:`verdict_rows` folds them into one :class:`ClauseVerdict` per clause:

* ``PASS``: every case that ran passed;
* ``FAIL``: at least one failed; the row counts them, quotes the first failure and gives the
  command that reruns it alone (one root cause is one row, not one line per case);
* ``NOT DECLARED``: nothing ran because the implementation does not declare the capability the
  clause judges (``deterministic``, ``input_checks``, ...);
* ``UNSUPPORTED``: nothing ran because every case lies outside its declared shapes or dtypes;
* ``NOT RUN``: nothing ran here for another reason (no GPU, a backend not usable), named.

Every fact the fold uses travels as data from where it arose, never read back from a message:
a case's :class:`Status` (one vocabulary for the audit's rows, the plugin's test reports and
this module), a skip's kind (:class:`SkipReason`, a ``str`` carrying it, so it is also the
message wherever one is expected), a failure's root cause (:class:`CountedUnderAccuracy`, the
exception type the accuracy judge and the layer tests raise). Rendered as Markdown
(:func:`markdown`) for people and JSON (:func:`as_json`) for dashboards.
"""
from __future__ import annotations

import unittest

from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum

# A clause's status, the words of the verdict table.
PASS, FAIL, NOT_DECLARED, UNSUPPORTED, NOT_RUN = "PASS", "FAIL", "NOT DECLARED", "UNSUPPORTED", "NOT RUN"
STATUSES = (FAIL, PASS, NOT_DECLARED, UNSUPPORTED, NOT_RUN)
SKIP_KINDS = (NOT_DECLARED, UNSUPPORTED, NOT_RUN)  # why a case was not judged, most telling first


class Status(str, Enum):
    """One case's outcome: an audit row's status, a test report's, an :class:`Outcome`'s. The
    values are the audit's words (its report and progress lines print them)."""

    PASS = "pass"  # judged, right
    FAIL = "FAIL"  # judged, wrong
    SKIP = "skip"  # not judged here: its SkipReason says why, and of which kind
    INFO = "info"  # an observation; judges nothing unless it carries a SkipReason

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class SkipReason(str):
    """Why a case was not judged, with its kind (one of :data:`SKIP_KINDS`) as data. A ``str``,
    so it is the message wherever one goes (``pytest.skip``, ``pytest.mark.skip(reason=...)``, a
    row's result) and reaches the verdict's fold unparsed; text built from it is plain text."""

    kind: str

    def __new__(cls, kind: str, text: str) -> "SkipReason":
        if kind not in SKIP_KINDS:
            raise ValueError(f"kind must be one of {SKIP_KINDS}, got {kind!r}")
        self = super().__new__(cls, text)
        self.kind = kind
        return self

    def __getnewargs__(self) -> tuple[str, str]:  # pickles (xdist, multiprocessing) keep the kind
        return self.kind, str(self)


def not_declared(text: str) -> SkipReason:
    """The implementation does not declare the capability the case needs."""
    return SkipReason(NOT_DECLARED, text)


def unsupported(text: str) -> SkipReason:
    """The case lies outside the implementation's declared shapes or dtypes."""
    return SkipReason(UNSUPPORTED, text)


def not_run(text: str) -> SkipReason:
    """Not run here for another reason (no GPU, a backend not usable, judged elsewhere)."""
    return SkipReason(NOT_RUN, text)


def skip_kind(reason) -> str:
    """A skip's kind: the one its :class:`SkipReason` carries; plain text is ``NOT RUN``."""
    return getattr(reason, "kind", NOT_RUN)


class LayerWrongOnItsOwn(unittest.SkipTest):
    """A layer case (a serving stream, a weight swap, poisoned rows) whose failure nothing of its
    own explains: the layer's first call is already wrong, or a fresh layer built from the same
    weights and given only the clean rows fails alike. No earlier call, change or poisoned row
    is to blame, so the case's own clause has nothing to judge.
    The clauses that judge a fresh layer report it (checkpoint, routing, accuracy). A
    ``unittest.SkipTest``, so pytest and Hypothesis end the case as a skip (NOT RUN) wherever it
    is raised, without shrinking; the audit makes it a NOT RUN row (:meth:`reason`)."""

    def reason(self) -> SkipReason:
        return not_run(str(self))


# Root causes a failure can carry besides its clause's own (Outcome.cause).
INACCURATE = "inaccurate"  # the accuracy judge failed it (bounds, baseline or faithfulness)
WRONG_FROM_THE_START = "wrong-from-the-start"  # a layer already wrong with its first weights
CAUSES = (INACCURATE, WRONG_FROM_THE_START)


class CountedUnderAccuracy(AssertionError):
    """A failure whose root cause is accuracy, with ``cause`` (one of :data:`CAUSES`) as data:
    the accuracy judge's failure (``magi_moe.judge.Inaccurate``) and a layer wrong before any weight
    change (``LayerWrongFromTheStart``). magi-moe's pytest plugin reads the cause from the
    exception (or one it was raised from), never from its message."""

    cause: str = INACCURATE


class LayerWrongFromTheStart(CountedUnderAccuracy):
    """The layer is already wrong with its first weights: the weight-change, graph and checkpoint
    cases meeting it judged nothing of their own, and count under accuracy wherever it stands."""

    cause = WRONG_FROM_THE_START


def cause_of(exc: BaseException | None) -> str | None:
    """The root cause ``exc`` carries, itself or through the exceptions it was raised from
    (``raise ... from``; not one merely being handled, a negative control's, say)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CountedUnderAccuracy):
            return exc.cause
        exc = exc.__cause__
    return None


@dataclass(frozen=True)
class Clause:
    name: str
    title: str
    contract: str  # where docs/CONTRACT.md (or docs/INPUTS.md) states it
    family: bool = False  # one row per route: "weight-change/copy_" (audit.cache's route names)


_FIXED = (
    Clause("accuracy", "output within the declared precision model's error bounds, every element "
           "written, at every declared dtype", "CONTRACT 1"),
    Clause("locality", "a (token, head) result depends on its own routes only: token order, head "
           "slices, linearity in the routing weights", "CONTRACT 1"),
    Clause("row-isolation", "a (token, head) result depends only on that token's row of x, its "
           "routes and the weights: NaN, Inf or garbage in other rows (padding rows included) "
           "never reaches it", "CONTRACT 1"),
    Clause("history", "a call's result does not depend on earlier calls on the same objects "
           "(other token counts, routes, weights, memory left dirty by them)", "CONTRACT 5"),
    Clause("edge-shapes", "no tokens, block-boundary token counts, one hot expert, empty experts, "
           "strided rows", "CONTRACT 1-2"),
    Clause("zero-rows", "a (token, head) pair with no route gets zeros", "CONTRACT 2"),
    Clause("routing", "the router: tie rule, NaN last, bias steers the choice only, L1 "
           "normalisation with eps, route_scale, head locality", "CONTRACT 1"),
    Clause("determinism", "bitwise identical output run after run (declared: deterministic)",
           "CONTRACT 6"),
    Clause("int64-offsets", "correct past 2^31 elements of row offset (declared: int64_offsets)",
           "CONTRACT 7"),
    Clause("input-checks", "the kernel itself refuses malformed calls before launching "
           "(declared: input_checks)", "INPUTS"),
    Clause("inputs-unchanged", "the call leaves x, the route table and the weights as they were",
           "CONTRACT 2"),
    Clause("layer-inputs", "the layer refuses bad input and keeps its state", "CONTRACT 3, INPUTS"),
    Clause("checkpoint", "the layer built from a released checkpoint computes that checkpoint's "
           "output and reports its tensors under their released names", "CONTRACT 3"),
    Clause("weight-change", "the layer follows every way weights change (one row per route: "
           "weight-change/<route>)", "CONTRACT 5", family=True),
    Clause("weight-swaps", "random sequences of weight changes never serve stale weights",
           "CONTRACT 5"),
    Clause("cuda-graph", "a captured CUDA graph is right after every weight-change route, or "
           "promises a recapture", "CONTRACT 8b", family=True),
    Clause("discipline", "no host sync once warm (declared: no_host_sync)", "CONTRACT 8b"),
    Clause("compile", "the layer under torch.compile", "CONTRACT 8b"),
    Clause("speed", "timed under pytest-benchmark on the anchor cases, after the judge passed "
           "(a wrong result fails here and is not timed)", "ANCHORS"),
    Clause("suite-self-check", "the suite's own checks: backend self-check, the bounds validated "
           "with mpmath, negative controls the bounds must flag", "CONTRACT 8"),
    Clause("other", "tests that name no clause (@pytest.mark.clause)", "-"),
)


def clauses() -> dict[str, Clause]:
    """Every fixed clause and family head, in report order."""
    return {c.name: c for c in _FIXED}


def families() -> tuple[str, ...]:
    """The clauses with one row per route (``family/route``)."""
    return tuple(c.name for c in _FIXED if c.family)


def clause(name: str) -> Clause:
    """The clause called ``name``; ``family/route`` names one route of a family."""
    known = clauses()
    if name in known:
        return known[name]
    family, _, route = name.partition("/")
    if family in families() and route:
        head = known[family]
        return Clause(name, f"{head.title.split(' (')[0]}: {route}", head.contract)
    raise ValueError(f"clause must be one of {list(known)} or family/route for a family of "
                     f"{families()}, got {name!r}")


def _order(name: str) -> tuple[int, str]:
    names = list(clauses())
    family = name.partition("/")[0]
    return (names.index(family) if family in names else len(names), name)


# -- what judged it ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    """One judged case: ``status`` a :class:`Status` (``"pass"``, ``"FAIL"``, ``"skip"``);
    ``detail`` the first line of the failure or the skip reason; ``repro`` a command that reruns
    it alone; ``kind`` a skip's kind (default: the one its ``detail`` carries as a
    :class:`SkipReason`, else ``NOT RUN``); ``cause`` a failure's root cause when it is not the
    clause's own (one of :data:`CAUSES`)."""

    subject: str   # "impl@backend"
    clause: str
    status: Status
    case: str = ""
    detail: str = ""
    repro: str = ""
    kind: str | None = None
    cause: str | None = None

    def __post_init__(self) -> None:
        try:
            status = Status(self.status)
        except ValueError:
            raise ValueError(f"status must be one of {[s.value for s in Status]}, "
                             f"got {self.status!r}") from None
        if status is Status.INFO:
            raise ValueError("status must be pass, FAIL or skip: an info row judges nothing "
                             "(give it a SkipReason to count as a skip)")
        object.__setattr__(self, "status", status)
        if status is Status.SKIP and self.kind is None:
            object.__setattr__(self, "kind", skip_kind(self.detail))
        if self.kind is not None and self.kind not in SKIP_KINDS:
            raise ValueError(f"kind must be one of {SKIP_KINDS}, got {self.kind!r}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"cause must be one of {CAUSES}, got {self.cause!r}")


@dataclass
class ClauseVerdict:
    subject: str
    clause: Clause
    status: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    detail: str = ""
    repro: str = ""
    failing_cases: list[str] = field(default_factory=list)

    def counts(self) -> str:
        parts = [f"{n} {w}" for n, w in ((self.passed, "passed"), (self.failed, "failed"),
                                          (self.skipped, "skipped")) if n]
        return ", ".join(parts) or "no case"

    def to_dict(self) -> dict:
        return {"subject": self.subject, "clause": self.clause.name, "title": self.clause.title,
                "contract": self.clause.contract, "status": self.status, "passed": self.passed,
                "failed": self.failed, "skipped": self.skipped, "detail": self.detail,
                "repro": self.repro, "failing_cases": self.failing_cases}


def _fold(subject: str, clause_: Clause, outcomes: list[Outcome]) -> ClauseVerdict:
    failed = [o for o in outcomes if o.status is Status.FAIL]
    passed = [o for o in outcomes if o.status is Status.PASS]
    skipped = [o for o in outcomes if o.status is Status.SKIP]
    row = ClauseVerdict(subject, clause_, PASS, len(passed), len(failed), len(skipped))
    if failed:
        first = failed[0]
        row.status, row.detail, row.repro = FAIL, first.detail, first.repro
        row.failing_cases = [o.case for o in failed]
        distinct = len({o.detail for o in failed})
        if distinct > 1:
            row.detail += f" (and {distinct - 1} other message{'s' if distinct > 2 else ''})"
    elif passed:
        if skipped:
            reason, n = Counter(o.detail for o in skipped).most_common(1)[0]
            row.detail = f"{len(skipped)} case(s) not run ({n}: {reason})"
    else:
        by_kind: dict[str, list[Outcome]] = {}
        for o in skipped:
            by_kind.setdefault(o.kind, []).append(o)
        kind = next(k for k in SKIP_KINDS if k in by_kind)
        row.status, row.detail = kind, by_kind[kind][0].detail
    return row


def _counted_under_accuracy(by_clause: dict[str, list[Outcome]]) -> dict[str, int]:
    """One root cause, one FAIL row: where the accuracy clause fails, another clause's cases that
    failed only on the accuracy judge (an edge shape computed inaccurately, say) move to the
    accuracy row. Where accuracy passes they stay: then the inaccuracy is the edge's own. A
    layer wrong before any weight change moves always: every weight-change and graph route
    meets the same wrong layer, and none of them was judged."""
    accuracy_failed = any(o.status is Status.FAIL for o in by_clause.get("accuracy", ()))

    def inaccurate(o: Outcome) -> bool:
        return o.status is Status.FAIL and (
            o.cause == WRONG_FROM_THE_START or (accuracy_failed and o.cause == INACCURATE))

    moved = {}
    for name in [c for c in by_clause if c != "accuracy"]:
        stay, taken = [], []
        for o in by_clause[name]:
            (taken if inaccurate(o) else stay).append(o)
        if taken:
            moved_here = [replace(o, clause="accuracy") for o in taken]
            by_clause.setdefault("accuracy", []).extend(moved_here)
            by_clause[name] = stay
            moved[name] = len(taken)
    return moved


def verdict_rows(outcomes: list[Outcome]) -> dict[str, list[ClauseVerdict]]:
    """Per subject (``impl@backend``, in first-seen order): one row per clause it met, in
    :func:`clauses` order (a family's routes by name). A clause with no outcome at all is left
    out (nothing judged it); an inaccuracy another clause met while accuracy fails, and a layer
    wrong before any weight change, are counted under accuracy (:func:`_counted_under_accuracy`)."""
    grouped: dict[str, dict[str, list[Outcome]]] = {}
    for o in outcomes:
        grouped.setdefault(o.subject, {}).setdefault(o.clause, []).append(o)
    out = {}
    for subject, by_clause in grouped.items():
        moved = _counted_under_accuracy(by_clause)
        rows = []
        for c in sorted(by_clause, key=_order):
            row = _fold(subject, clause(c), by_clause[c]) if by_clause[c] else \
                ClauseVerdict(subject, clause(c), NOT_RUN)
            if c in moved:
                note = f"{moved[c]} case(s) inaccurate, counted under accuracy"
                if row.status == NOT_RUN and not row.detail:
                    row.detail = "every case that ran was inaccurate, counted under accuracy"
                else:
                    row.detail = f"{row.detail}; {note}" if row.detail else note
            rows.append(row)
        out[subject] = rows
    return out


def overall(rows: list[ClauseVerdict]) -> str:
    if any(r.status == FAIL for r in rows):
        return FAIL
    return PASS if any(r.status == PASS for r in rows) else NOT_RUN


# -- rendering -------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _short(text: str, width: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def markdown(table: dict[str, list[ClauseVerdict]], *, title: str = "magi-moe verdict") -> str:
    lines = [f"# {title}", ""]
    for subject, rows in table.items():
        lines += [f"## {subject}: {overall(rows)}", "",
                  "| clause | status | cases | detail | rerun the first failure |",
                  "|---|---|---|---|---|"]
        for r in rows:
            repro = f"`{r.repro}`" if r.repro else ""
            lines.append(f"| {r.clause.name} ({r.clause.contract}) | **{r.status}** | {r.counts()} "
                         f"| {_cell(_short(r.detail))} | {_cell(repro)} |")
        lines.append("")
    return "\n".join(lines)


def text_lines(table: dict[str, list[ClauseVerdict]]) -> list[str]:
    """The terminal form: one line per clause, the rerun command on the line below a FAIL;
    subjects that ran nothing here share one line per reason."""
    lines = []
    idle: dict[str, list[str]] = {}
    for subject, rows in table.items():
        if overall(rows) == NOT_RUN and all(r.status == NOT_RUN for r in rows):
            idle.setdefault(rows[0].detail, []).append(subject)
            continue
        lines.append(f"{subject}: {overall(rows)}")
        width = max(len(r.clause.name) for r in rows)
        for r in rows:
            lines.append(f"  {r.clause.name:<{width}}  {r.status:<12}  {r.counts():<28}  "
                         f"{_short(r.detail, 110)}")
            if r.repro:
                lines.append(f"  {'':<{width}}  rerun: {r.repro}")
    for reason, subjects in idle.items():
        lines.append(f"NOT RUN here ({reason}): {', '.join(subjects)}")
    return lines


def as_json(table: dict[str, list[ClauseVerdict]]) -> dict:
    return {"subjects": [{"subject": s, "verdict": overall(rows),
                          "clauses": [r.to_dict() for r in rows]} for s, rows in table.items()]}
