"""``python -m audit``: every auditor in one run, a summary table, report.md, report.json, plots.

:class:`Audit` runs the sections of :data:`audit.sections.SECTIONS` in order: backend
self-check; the bounds' own mpmath validation; each implementation on each probe judged by
:func:`magi_moe.judge.judge` (error bounds first, then the FlashAttention-style baseline ratio and
faithfulness to its precision model's emulation); each implementation's router judged by
:func:`audit.router_judge.judge_router_call`; negative controls (broken emulations the bounds
must flag); determinism; weight cache; discipline and ``torch.compile`` (CUDA); CUDA-graph
replay (CUDA); coverage. Each yields rows with a status: ``pass``, ``FAIL``, ``info`` or
``skip``. Any ``FAIL`` makes the exit status 1.
"""
from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from magi_moe.backends import Backend, get_backend
from magi_moe.config import preset
from magi_moe.problems import Problem
from magi_moe.implementation import Implementation
from magi_moe.registry import get_implementation, implementations
from magi_moe.text_tables import format_table
from magi_moe.verdict import as_json as verdict_json, markdown as verdict_markdown, \
    text_lines as verdict_text, verdict_rows

from magi_moe.judge.bounds import DEFAULT_FAILURE_PROBABILITY, BoundReport
from .clauses import audit_outcomes
from .plots import write_plots
from magi_moe.judge.precision import precision_model
from .probes import PROBE_DESCRIPTIONS, PROBES, probe_problem
from .rows import FAIL, INFO, PASS, SKIP, SUITE, Row  # noqa: F401 -- also imported from here
from .sections import SECTIONS, Section, section_named


@dataclass
class AuditOptions:
    backend: str = "cpu"
    impls: list[str] = field(default_factory=list)  # empty: every registered one runnable here
    presets: list[str] = field(default_factory=list)
    tokens: int | None = None
    seed: int = 0
    out: Path = Path("audit-report")
    probes: tuple[str, ...] = PROBES
    determinism_runs: int | None = None
    controls: bool = True
    mp_validation: bool = True
    failure_probability: float = DEFAULT_FAILURE_PROBABILITY
    allow_no_kernels: bool = False

    def resolved_presets(self) -> list[str]:
        return self.presets or list(get_backend(self.backend).audit_presets)

    def resolved_tokens(self) -> int:
        return self.tokens or get_backend(self.backend).audit_tokens


class Audit:
    """Runs the sections, prints progress, keeps every row for the report files."""

    def __init__(self, options: AuditOptions, stream=None):
        self.options = options
        self.backend: Backend = get_backend(options.backend)
        self.device = torch.device(self.backend.device)
        self.rows: list[Row] = []
        self.bound_reports: list[tuple[str, str, str, BoundReport]] = []  # preset, probe, impl
        self.problems: dict[str, Problem] = {}  # each preset's random problem (bounds section)
        self.stream = stream
        self.started = time.perf_counter()

    # -- output ------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def record(self, row: Row, section: Section | None = None) -> Row:
        """Keep ``row`` for the report and print it as a progress line. A row of an
        implementation gets its ``section``'s clause unless it names its own, and the backend
        its implementation ran on."""
        if row.impl is not None:
            if row.clause is None and section is not None:
                row.clause = section.clause
            if row.backend is None and row.impl != SUITE:
                row.backend = self.runs_on(row.impl)
        self.rows.append(row)
        elapsed = time.perf_counter() - self.started
        self.say(f"[{elapsed:6.1f}s] {row.section:<12} {row.subject:<42} {row.status.upper():<5} "
                 f"{row.result}")
        return row

    @property
    def failed(self) -> bool:
        return any(r.status == FAIL for r in self.rows)

    # -- implementations -----------------------------------------------------------------------
    def selected_impls(self) -> list[Implementation]:
        if self.options.impls:
            return [get_implementation(n) for n in self.options.impls]
        return implementations()

    def runs_on(self, name: str) -> str:
        """Where the implementation called ``name`` runs in this audit: on the cpu backend a
        Triton implementation runs under the interpreter (``Backend.audits_kernels_on``)."""
        impl = next((i for i in self.selected_impls() if i.name == name), None)
        kernels_on = self.backend.audits_kernels_on
        if kernels_on and impl is not None and self.backend.name not in impl.backends:
            return kernels_on
        return self.backend.name

    def runnable_here(self, impl: Implementation) -> str | None:
        """Why ``impl`` cannot run on this audit's device, or None. The ``cpu`` backend audits
        whatever runs on CPU tensors: Triton implementations too, under the interpreter."""
        where = self.device if self.backend.audits_kernels_on else self.backend
        return impl.skip_reason(where)

    def model_for(self, impl: Implementation, config):
        """The declared model. Kernels are held to round-to-nearest even under the interpreter,
        whose own fp32 -> bf16 conversion truncates (the self-check reports it): they must round
        by bit arithmetic there (``magi_moe.kernels.rounding``). ``magi_moe.judge.precision.
        with_truncating_downcasts`` gives the model a truncating kernel would need."""
        return precision_model(impl.precision_for(config), config.dtype)

    # -- sections ------------------------------------------------------------------------------
    def main_problem(self) -> Problem:
        """The random problem of the first preset (built now if the bounds section had none)."""
        name = self.options.resolved_presets()[0]
        if name not in self.problems:
            self.problems[name] = probe_problem("random", preset(name), self.options.resolved_tokens(),
                                                seed=self.options.seed, device=self.device)
        return self.problems[name]

    def run(self) -> int:
        o = self.options
        self.say(f"magi-moe audit: backend {self.backend.name} ({backend_description(self.backend)}), "
                 f"presets {o.resolved_presets()}, {o.resolved_tokens()} tokens, seed {o.seed}")
        for section in SECTIONS:
            self.run_section(section)
        self.write()
        if self.failed:
            return 1
        return 3 if self.vacuous else 0

    def run_section(self, section: Section | str) -> None:
        """Record the rows of one section (:mod:`audit.sections`) as it yields them. An error
        escaping it (an outside ``supports()`` or layer factory that raises, say) is that
        section's FAIL row, and the sections after it and the report still run: an audit never
        loses what it has finished."""
        if isinstance(section, str):
            section = section_named(section)
        if section.option and not getattr(self.options, section.option):
            return
        if section.cuda_only and self.device.type != "cuda":
            self.record(Row(section.name, section.cuda_only, SKIP, "CUDA only"))
            return
        try:
            for row in section.run(self):
                self.record(row, section)
        except Exception as exc:  # noqa: BLE001 -- reported as a failure, never swallowed
            text = f"{type(exc).__name__}: {exc}".splitlines()[0]
            # the section's clause fails (the suite's own, for a section of several clauses)
            self.record(Row(section.name, "section stopped", FAIL, f"raised {text}",
                            {"traceback": traceback.format_exc()}, impl=SUITE,
                            clause=section.clause or "suite-self-check"))

    @property
    def vacuous(self) -> bool:
        """No implementation under test ran (the coverage section's skip rows): exit status 3."""
        return any(r.section == "coverage" and r.status == SKIP for r in self.rows)

    # -- files ---------------------------------------------------------------------------------
    def outcomes(self):
        """The rows as verdict outcomes (:mod:`audit.clauses`)."""
        selected = self.selected_impls()
        specs = {}
        for given, impl in zip(self.options.impls, selected) if self.options.impls else ():
            specs[impl.name] = given if isinstance(given, str) else impl.name
        impls = {i.name: specs.get(i.name, i.name) for i in selected}
        return audit_outcomes(self.rows, impls=impls, backend=self.backend.name)

    def write(self) -> None:
        out = Path(self.options.out)
        out.mkdir(parents=True, exist_ok=True)
        plots, plots_missing = [], None
        try:
            plots = write_plots(self.bound_reports, out)
        except ImportError as exc:  # the report is the audit's result; plots only illustrate it
            plots_missing = (f"plots not written: {exc.name or exc} is not installed "
                             f"(pip install matplotlib, or the [audit] extra)")
        meta = environment(self.backend, self.options)
        if plots_missing:
            meta["plots"] = plots_missing
        meta["seconds"] = round(time.perf_counter() - self.started, 1)
        (out / "report.json").write_text(json.dumps(
            {"meta": meta, "ok": not self.failed and not self.vacuous, "vacuous": self.vacuous,
             "rows": [dict(r.__dict__) for r in self.rows]},
            indent=1, default=str))
        (out / "report.md").write_text(markdown(self.rows, meta, plots, not self.failed and not self.vacuous))
        try:
            table = verdict_rows(self.outcomes())
        except Exception as exc:  # noqa: BLE001 -- the report above is written; say why no verdict
            table = {}
            self.say(f"verdict not written: {type(exc).__name__}: {exc}")
        (out / "verdict.md").write_text(verdict_markdown(table, title="magi-moe audit verdict") + "\n")
        (out / "verdict.json").write_text(json.dumps(verdict_json(table), indent=1) + "\n")
        self.say("")
        self.say(summary_table(self.rows))
        self.say("\nverdict, one row per contract clause (verdict.md, verdict.json):")
        for line in verdict_text(table):
            self.say(line)
        verdict = "FAILED" if self.failed else ("NOTHING AUDITED" if self.vacuous else "PASSED")
        if self.vacuous:
            self.say("\nno implementation under test ran (see the coverage rows); exit status 3, "
                     "--allow-no-kernels accepts such a run")
        self.say(f"\n{verdict} in {meta['seconds']} s; "
                 f"report in {out}/ ({', '.join(['report.md', 'report.json', *plots])})")
        if plots_missing:
            self.say(plots_missing)


def backend_description(backend: Backend) -> str:
    """What the backend audits in this run: the cpu backend also audits the Triton kernels
    when the interpreter is on (``Audit.runnable_here``)."""
    if backend.audits_kernels_on and get_backend(backend.audits_kernels_on).available:
        return backend.kernels_audit_description
    return backend.description


def environment(backend: Backend, options: AuditOptions) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = (torch.cuda.get_device_name(0) if backend.device == "cuda" and torch.cuda.is_available()
              else platform.processor() or platform.machine())
    return {"backend": backend.name, "audits": backend_description(backend), "device": device, "torch": torch.__version__,
            "triton": triton_version, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "presets": options.resolved_presets(),
            "tokens": options.resolved_tokens(), "seed": options.seed,
            "probes": list(options.probes), "failure_probability": options.failure_probability}


def summary_table(rows: list[Row]) -> str:
    """Per section: counts by status, and the failing subjects (whole)."""
    table = []
    for s in dict.fromkeys(r.section for r in rows):
        mine = [r for r in rows if r.section == s]
        count = lambda st: sum(r.status == st for r in mine)  # noqa: E731
        table.append([s, count(PASS), count(FAIL), count(INFO), count(SKIP),
                      ", ".join(r.subject for r in mine if r.status == FAIL)])
    return format_table(["section", "pass", "FAIL", "info", "skip", "failures"], table,
                        numeric_columns=(1, 2, 3, 4))


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[Row], meta: dict, plots: list[str], ok: bool) -> str:
    out = [f"# magi-moe audit: {'PASSED' if ok else 'FAILED'}", "",
           ", ".join(f"{k}: {v}" for k, v in meta.items()), "",
           "Error bounds: per element, |out - float64 reference| against an a-priori worst-case "
           "bound (must never be exceeded) and a probabilistic one (Higham & Mary 2019; exceeded "
           f"with probability < {meta['failure_probability']:g} by an implementation that follows "
           "its precision model). Each bounds row is the accuracy judge's verdict "
           "(`magi_moe.judge`): the bounds first, then at most twice the plain PyTorch baseline's "
           "error plus one rounding (FlashAttention-style), then faithfulness to the precision "
           "model's emulation where it promises that. Probes:", ""]
    out += [f"- `{k}`: {v}" for k, v in PROBE_DESCRIPTIONS.items()]
    out += ["", "## Summary", "", "```", summary_table(rows), "```", ""]
    for section in dict.fromkeys(r.section for r in rows):
        out += [f"## {section}", "", "| subject | status | result |", "|---|---|---|"]
        out += [f"| {_md_escape(r.subject)} | {r.status} | {_md_escape(r.result)} |"
                for r in rows if r.section == section]
        out.append("")
        if section == "bounds":
            out += _quantile_table(rows) + [""]
    if plots:
        out += ["## Plots", "", "A legend entry `a = b` is one series both produced exactly, `a ~ b` one they "
                "produced alike at the plot's scale (the tables above keep the numbers).", ""]
        out += [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(out)


def _quantile_table(rows: list[Row]) -> list[str]:
    lines = ["Distribution of error / probabilistic bound:", "",
             "| implementation @ preset/probe | p50 | p90 | p99 | p99.9 | max | lam |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r.data.get("bounds")
        if r.section == "bounds" and b:
            q = b["prob_quantiles"]
            lines.append(f"| {_md_escape(r.subject)} | " + " | ".join(
                f"{q.get(k, 0):.3g}" for k in ("p50", "p90", "p99", "p99.9"))
                + f" | {b['prob_max_ratio']:.3g} | {b['lam']:.2f} |")
    return lines
