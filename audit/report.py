"""``python -m audit``: every auditor in one run, a summary table, report.md, report.json, plots.

Sections, in order: backend self-check; the bounds' own mpmath validation; each implementation
on each probe judged by :func:`audit.judge.judge` (error bounds first, then the FlashAttention-style
baseline ratio and faithfulness to its precision model's emulation); each implementation's
router judged by :func:`audit.router_judge.judge_router_call` (:mod:`audit.router_audit`); negative controls
(broken emulations the bounds must flag); determinism; weight cache; discipline and
``torch.compile`` (CUDA). Each produces rows with a status: ``pass``, ``FAIL``, ``info`` or
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
from magi_moe.layer import MagiMoE
from magi_moe.problems import Problem, cancelling_problem, run_poisoned
from magi_moe.implementation import Implementation
from magi_moe.impls import BASELINE, REFERENCE
from magi_moe.registry import get_implementation, implementations
from magi_moe.text_tables import format_table
from magi_moe.verdict import as_json as verdict_json, markdown as verdict_markdown, \
    text_lines as verdict_text, verdict_rows

from . import mpcheck
from .bounds import DEFAULT_FAILURE_PROBABILITY, BoundReport, compute_error_bounds, evaluate_bounds
from .cache import audit_weight_cache
from .clauses import audit_outcomes
from .determinism import audit_determinism, audit_layer_determinism
from .emulation import FP32ACC_EMULATION, negative_controls
from .judge import judge
from .plots import write_plots
from .precision import precision_model
from .probes import PROBE_DESCRIPTIONS, PROBES, probe_problem
from .router_audit import section_routing
from .selfcheck import run_selfcheck

PASS, FAIL, INFO, SKIP = "pass", "FAIL", "info", "skip"


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
        if self.presets:
            return self.presets
        return ["magi2-ep4-local", "magi2-full"] if self.backend == "cuda" else ["small"]

    def resolved_tokens(self) -> int:
        return self.tokens or (4096 if self.backend == "cuda" else 128)


@dataclass
class Row:
    section: str
    subject: str
    status: str
    result: str
    data: dict = field(default_factory=dict)


class Audit:
    """Runs the sections, prints progress, keeps every row for the report files."""

    def __init__(self, options: AuditOptions, stream=None):
        self.options = options
        self.backend: Backend = get_backend(options.backend)
        self.device = torch.device(self.backend.device)
        self.rows: list[Row] = []
        self.bound_reports: list[tuple[str, str, str, BoundReport]] = []  # preset, probe, impl
        self.stream = stream
        self.started = time.perf_counter()

    # -- output ------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def add(self, section: str, subject: str, status: str, result: str,
            data: dict | None = None) -> Row:
        row = Row(section, subject, status, result, data or {})
        self.rows.append(row)
        elapsed = time.perf_counter() - self.started
        self.say(f"[{elapsed:6.1f}s] {section:<12} {subject:<42} {status.upper():<5} {result}")
        return row

    @property
    def failed(self) -> bool:
        return any(r.status == FAIL for r in self.rows)

    # -- implementations -----------------------------------------------------------------------
    def selected_impls(self) -> list[Implementation]:
        if self.options.impls:
            return [get_implementation(n) for n in self.options.impls]
        return implementations()

    def runnable_here(self, impl: Implementation) -> str | None:
        """Why ``impl`` cannot run on this audit's device, or None. The ``cpu`` backend audits
        whatever runs on CPU tensors: Triton implementations too, under the interpreter."""
        where = torch.device("cpu") if self.backend.name == "cpu" else self.backend
        return impl.skip_reason(where)

    def model_for(self, impl: Implementation, config):
        """The declared model. Kernels are held to round-to-nearest even under the interpreter,
        whose own fp32 -> bf16 conversion truncates (the self-check reports it): they must round
        by bit arithmetic there (``magi_moe.kernels.rounding``). ``audit.precision.
        with_truncating_downcasts`` gives the model a truncating kernel would need."""
        return precision_model(impl.precision_for(config), config.dtype)

    # -- sections ------------------------------------------------------------------------------
    def run(self) -> int:
        o = self.options
        self.say(f"magi-moe audit: backend {self.backend.name} ({backend_description(self.backend)}), "
                 f"presets {o.resolved_presets()}, {o.resolved_tokens()} tokens, seed {o.seed}")
        self.guarded("selfcheck", self.section_selfcheck)
        if o.mp_validation:
            self.guarded("mpcheck", self.section_mpcheck)
        problems = self.guarded("bounds", self.section_bounds) or {}
        self.guarded("routing", section_routing, self)
        if o.controls:
            self.guarded("controls", self.section_controls)
        self.guarded("determinism", self.section_determinism, problems)
        self.guarded("cache", self.section_cache)
        self.guarded("discipline", self.section_discipline, problems)
        self.guarded("graphs", self.section_graphs)
        self.guarded("coverage", self.section_coverage)
        self.write()
        if self.failed:
            return 1
        return 3 if self.vacuous else 0

    def guarded(self, section: str, run, *args):
        """Run one section; an error escaping it (an outside ``supports()`` or layer factory that
        raises, say) is that section's FAIL row, and the sections after it and the report still
        run: an audit never loses what it has finished."""
        try:
            return run(*args)
        except Exception as exc:  # noqa: BLE001 -- reported as a failure, never swallowed
            text = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self.add(section, "section stopped", FAIL, f"raised {text}",
                     {"traceback": traceback.format_exc()})
            return None

    def section_graphs(self) -> None:
        """CUDA-graph replay after each weight-change route, on each implementation's own layer
        (:mod:`audit.graphs`): graph-safe, stale (a finding unless the layer promises a
        recapture, which must then work) or refused."""
        if self.device.type != "cuda":
            self.add("graphs", "CUDA-graph replay", SKIP, "CUDA only")
            return
        from .graphs import audit_graph_replay

        config = preset("small")
        for impl in self.selected_impls():
            why = self.runnable_here(impl) or impl.supports(config)
            if why:
                self.add("graphs", impl.name, SKIP, why)
                continue

            def show(r, impl=impl):
                # a layer whose forward cannot be captured at all is reported, not failed
                status = INFO if r.detail.startswith("capture failed") else (PASS if r.ok else FAIL)
                self.add("graphs", f"{impl.name}: {r.route}/{r.parameter}", status,
                         f"{r.status} (promised {r.promised}): {r.detail}", r.to_dict())

            audit_graph_replay(impl.layer, config, device=self.device, seed=self.options.seed,
                               on_result=show)

    @property
    def vacuous(self) -> bool:
        return any(r.section == "coverage" and r.status == SKIP for r in self.rows)

    def section_coverage(self) -> None:
        """Which implementations under test were audited at all: an audit in which none ran
        (or an asked-for one never ran) audited nothing, and says why."""
        ran = {r.subject.split(" @ ")[0] for r in self.rows if r.section == "bounds" and r.status in (PASS, FAIL)}
        oracles = {REFERENCE.name, BASELINE.name}
        asked = self.selected_impls() if self.options.impls else [
            i for i in self.selected_impls() if i.name not in oracles]
        skipped = {r.subject.split(" @ ")[0]: r.result for r in self.rows
                   if r.section == "bounds" and r.status == SKIP}
        missing = [i for i in asked if i.name not in ran]
        if self.options.impls:
            for impl in asked:
                if impl.name in ran:
                    self.add("coverage", impl.name, PASS, "audited")
        elif ran - oracles:
            self.add("coverage", "implementations under test", PASS,
                     f"audited: {', '.join(sorted(ran - oracles))}")
        if missing and (self.options.impls or not (ran - oracles)):
            status = INFO if self.options.allow_no_kernels else SKIP
            for impl in missing:
                self.add("coverage", impl.name, status,
                         f"NOT AUDITED: {skipped.get(impl.name, 'no bound check ran')}")

    def section_selfcheck(self) -> None:
        backend = self.backend
        if backend.name == "cpu" and get_backend("interpret").available:
            backend = get_backend("interpret")
        checks = run_selfcheck(backend, seed=self.options.seed)
        for c in checks:
            self.add("selfcheck", f"{backend.name}: {c.name}", c.status, c.detail)

    def section_mpcheck(self) -> None:
        for c in mpcheck.iter_checks(seed=self.options.seed, quick=True):
            self.add("mpcheck", c.name, PASS if c.ok else FAIL, c.detail, {"name": c.name})

    def section_bounds(self) -> dict[str, Problem]:
        o = self.options
        impls = self.selected_impls()
        baseline = BASELINE
        random_problems = {}
        runnable = []
        for impl in impls:
            why = self.runnable_here(impl)
            if why:
                self.add("bounds", impl.name, SKIP, why)
            else:
                runnable.append(impl)
        for preset_name in o.resolved_presets():
            # each implementation at the preset, or at the nearest widths its shape rule accepts
            groups: dict = {}
            for impl in runnable:
                config = impl.shapes.nearest(preset(preset_name))
                why = impl.supports(config)
                if why:
                    self.add("bounds", f"{impl.name} @ {preset_name}", SKIP, f"unsupported: {why}")
                    continue
                groups.setdefault(config, []).append(impl)
            for config, here in groups.items():
                label = preset_name if config == preset(preset_name) else (
                    f"{preset_name}(Dh={config.head_dim},I={config.intermediate_size})")
                self._bounds_for(config, label, here, baseline, random_problems)
        return random_problems

    def _bounds_for(self, config, label, here, baseline, random_problems) -> None:
        o = self.options
        models = {i.name: self.model_for(i, config) for i in here}
        for probe in o.probes:
            problem = probe_problem(probe, config, o.resolved_tokens(), seed=o.seed,
                                    device=self.device)
            if probe == "random":
                random_problems.setdefault(label.split("(")[0], problem)
            bounds = compute_error_bounds(problem.x, problem.table, problem.weights, config,
                                          set(models.values()),
                                          failure_probability=o.failure_probability)
            base_out = run_poisoned(baseline, problem)
            for impl in here:
                self._check_bounds(impl, problem, bounds[models[impl.name].name], base_out,
                                   label, probe)
        return random_problems

    def _check_bounds(self, impl, problem, bounds, base_out, preset_name, probe) -> None:
        start = time.perf_counter()
        try:
            out = run_poisoned(impl, problem)
        except Exception as exc:  # noqa: BLE001 -- a crash is a finding
            self.add("bounds", f"{impl.name} @ {preset_name}/{probe}", FAIL,
                     f"{type(exc).__name__}: {exc}")
            return
        seconds = time.perf_counter() - start
        verdict = judge(out, problem, impl, bounds=bounds, baseline=base_out)
        report = verdict.bound_report
        data = {"judge": verdict.metrics, "text": verdict.text, "seconds": seconds,
                "preset": preset_name, "probe": probe}
        if report is None:  # not finite: the judge looked no further
            result = verdict.deciding.text
        else:
            self.bound_reports.append((preset_name, probe, impl.name, report))
            data["bounds"] = report.to_dict()
            result = (f"{report.model}: err/bound max {report.worst_max_ratio:.3g} worst-case, "
                      f"{report.prob_max_ratio:.3g} probabilistic; rel L2 {report.relative_l2:.2e}")
            versus = verdict.check("baseline")  # absent for fp32 inputs (see audit.judge)
            if versus is not None:
                result += f"; vs {BASELINE.name} {versus.figures['baseline_ratio']:.2f}x"
            faithful = verdict.check("faithfulness")
            if faithful is not None and "within_one_ulp" in faithful.figures:
                result += f"; {faithful.figures['within_one_ulp']:.2%} within one ulp of its emulation"
        if not verdict.ok:
            result += f" -- FAILED on {verdict.criterion}: {verdict.deciding.text}"
        self.add("bounds", f"{impl.name} @ {preset_name}/{probe}", PASS if verdict.ok else FAIL,
                 result, data)

    def section_controls(self) -> None:
        """Broken emulations on the CPU at the small preset: each must be flagged on some probe."""
        config = preset("small")
        problems = {p: probe_problem(p, config, 128, seed=self.options.seed) for p in PROBES}
        correct = FP32ACC_EMULATION
        for impl in (correct,) + negative_controls():
            flagged = []
            worst = 0.0
            for probe, problem in problems.items():
                report = evaluate_bounds(run_poisoned(impl, problem),
                                         _bounds_cache(problem, "bf16-fp32acc",
                                                       self.options.failure_probability),
                                         label=impl.name)
                worst = max(worst, report.prob_max_ratio)
                if not report.ok:
                    flagged.append(f"{probe} ({report.prob_max_ratio:.3g})")
            if impl is correct:
                status = PASS if not flagged else FAIL
                result = (f"passes every probe (max err/prob. bound {worst:.3g})" if not flagged
                          else f"flagged on {', '.join(flagged)}")
            else:
                status = PASS if flagged else FAIL
                result = (f"flagged on {', '.join(flagged)}" if flagged else
                          f"NOT flagged (max err/prob. bound {worst:.3g}): the bounds lost their power")
            self.add("controls", f"{impl.name}: {impl.description}", status, result,
                     {"description": impl.description})

    def main_problem(self, problems: dict[str, Problem]) -> Problem:
        """The random problem of the first preset (built now if the bounds section had none)."""
        name = self.options.resolved_presets()[0]
        if name not in problems:
            problems[name] = probe_problem("random", preset(name), self.options.resolved_tokens(),
                                           seed=self.options.seed, device=self.device)
        return problems[name]

    def section_determinism(self, problems: dict[str, Problem]) -> None:
        o = self.options
        if self.device.type == "cuda":
            problem = self.main_problem(problems)
            runs = o.determinism_runs or 20
        else:  # the interpreter runs programs one after another: a small input shows as much
            problem = probe_problem("random", preset("tiny"), 64, seed=o.seed)
            runs = o.determinism_runs or 3
        for impl in self.selected_impls():
            config = impl.shapes.nearest(problem.config)  # inside the declared shapes
            why = self.runnable_here(impl) or impl.supports(config)
            if why:
                self.add("determinism", impl.name, SKIP, why)
                continue
            mine = problem if config == problem.config else probe_problem(
                "random", config, problem.num_tokens, seed=o.seed, device=self.device)
            report = audit_determinism(impl, mine, runs=runs)
            self._determinism_row(impl.name, report, runs)
            cancelling = cancelling_problem(config, max(64, problem.num_tokens // 4), seed=o.seed,
                                            device=self.device)
            if impl.supports(cancelling.config) is None:  # where a changing sum order shows
                report = audit_determinism(impl, cancelling, runs=runs,
                                           label=f"{impl.name} (cancelling sums)")
                self._determinism_row(report.label, report, runs)
            if impl.deterministic:  # the implementation's own layer: routing, cache and kernels
                from .cache import draw_state

                layer = impl.layer(config, draw_state(config, o.seed, self.device), self.device)
                report = audit_layer_determinism(layer, mine.x, runs=runs, declared=True,
                                                 label=f"{impl.name}.layer()")
                self._determinism_row(report.label, report, runs)

    def _determinism_row(self, subject: str, report, runs: int) -> None:
        status = (PASS if report.ok else FAIL) if report.declared_deterministic else INFO
        self.add("determinism", subject, status,
                 f"{report.differing}/{report.elements} elements differ over {runs} runs "
                 f"(max |diff| {report.max_abs_spread:.3g})"
                 + ("" if report.declared_deterministic else "; not declared deterministic"),
                 report.to_dict())

    def section_cache(self) -> None:
        """The weight-cache audit (:mod:`audit.cache`) on each selected implementation's own
        layer (``impl.layer``) that shows a cache or whose implementation declares
        ``weight_cache``."""
        from .cache import SKIPPED, cache_protocol, draw_state

        o = self.options
        # Cache behaviour does not depend on the shape; fresh production layers would cost
        # seconds each to draw, and interpreted kernels pay per operation.
        sizes = ("small", "tiny") if self.device.type == "cuda" else ("tiny", "small")
        audited = 0
        for impl in self.selected_impls():
            declared = "weight_cache" in impl.capabilities
            config = next((preset(n) for n in sizes if impl.supports(preset(n)) is None), None)
            why = self.runnable_here(impl) or (None if config else impl.supports(preset(sizes[0])))
            if why:
                if declared:
                    self.add("cache", impl.name, SKIP, why)
                continue
            try:
                layer = impl.layer(config, draw_state(config, o.seed, self.device), self.device)
                shows = cache_protocol(layer).offered
                del layer
            except Exception as exc:  # noqa: BLE001 -- reported, the audit goes on
                self.add("cache", impl.name, FAIL, f"impl.layer(...) raised {type(exc).__name__}: {exc}")
                continue
            if not (declared or shows):
                continue
            audited += 1

            def show(r, impl=impl):
                status = SKIP if r.status == SKIPPED else (PASS if r.ok else FAIL)
                self.add("cache", f"{impl.name}: {r.route}/{r.parameter}", status,
                         f"{r.status}: {r.detail}", r.to_dict())

            report = audit_weight_cache(impl, config=config, device=self.device, label=impl.name,
                                        seed=o.seed, on_result=show)
            if not report.measures_packs:
                self.add("cache", impl.name, INFO, "its layer offers no pack count (layer.pack_count "
                         "or layer.weight_cache.pack_count): repacks not measured")
        if not audited:
            self.add("cache", "weight cache", SKIP,
                     "no selected implementation's layer shows a cache or declares weight_cache")

    def section_discipline(self, problems: dict[str, Problem]) -> None:
        if self.device.type != "cuda":
            self.add("discipline", "host sync / allocations / compile", SKIP, "CUDA only")
            return
        from .discipline import audit_compile, audit_discipline, audit_layer_discipline
        from .cache import draw_state

        problem = self.main_problem(problems)
        for impl in self.selected_impls():
            if self.runnable_here(impl) or impl.is_oracle:
                continue
            why = impl.supports(problem.config)
            if why:
                self.add("discipline", impl.name, SKIP, f"unsupported: {why}")
                continue
            report = audit_discipline(impl, problem)
            status = (PASS if report.ok else FAIL) if report.declares_no_host_sync else INFO
            self.add("discipline", impl.name, status, report.summary().split(": ", 1)[1],
                     report.to_dict())
        config = problem.config
        state = draw_state(config, self.options.seed, self.device)
        own_layer = lambda impl: impl.layer(config, state, self.device)  # noqa: E731
        for impl in self.selected_impls():
            if "no_host_sync" in impl.capabilities and not self.runnable_here(impl):
                report = audit_layer_discipline(
                    lambda impl=impl: own_layer(impl), num_tokens=problem.num_tokens,
                    seed=self.options.seed, label=f"{impl.name}.layer()", config=config)
                self.add("discipline", report.label, PASS if report.ok else FAIL,
                         report.summary().split(": ", 1)[1], report.to_dict())
        factories = {"MagiMoE(default dispatch)": lambda: MagiMoE(config, device=self.device)}
        for impl in self.selected_impls():
            if "weight_cache" in impl.capabilities and not self.runnable_here(impl):
                factories[f"{impl.name}.layer()"] = lambda impl=impl: own_layer(impl)
        for label, factory in factories.items():
            report = audit_compile(factory, label=label, seed=self.options.seed, config=config)
            self.add("compile", label, PASS if report.ok else FAIL, report.detail)

    # -- files ---------------------------------------------------------------------------------
    def outcomes(self):
        """The rows as verdict outcomes (:mod:`audit.clauses`)."""
        selected = self.selected_impls()
        specs = {}
        for given, impl in zip(self.options.impls, selected) if self.options.impls else ():
            specs[impl.name] = given if isinstance(given, str) else impl.name
        impls = {i.name: specs.get(i.name, i.name) for i in selected}
        runs_on = {i.name: ("interpret" if self.backend.name == "cpu" and "cpu" not in i.backends
                            else self.backend.name) for i in selected}
        return audit_outcomes(self.rows, impls=impls, backend=self.backend.name, runs_on=runs_on)

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


_BOUNDS: dict = {}


def _bounds_cache(problem: Problem, model: str, failure_probability: float):
    key = (id(problem), model)
    if key not in _BOUNDS or _BOUNDS[key][0] is not problem:
        _BOUNDS[key] = (problem, compute_error_bounds(
            problem.x, problem.table, problem.weights, problem.config, [model],
            failure_probability=failure_probability)[model])
    return _BOUNDS[key][1]


def backend_description(backend: Backend) -> str:
    """What the backend audits in this run: the cpu backend also audits the Triton kernels
    when the interpreter is on (``Audit.runnable_here``)."""
    if backend.name == "cpu" and get_backend("interpret").available:
        return ("the CPU: the torch paths, and the Triton kernels under the interpreter "
                "(TRITON_INTERPRET=1)")
    return backend.description


def environment(backend: Backend, options: AuditOptions) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = (torch.cuda.get_device_name(0) if backend.name == "cuda" and torch.cuda.is_available()
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
           "(`audit.judge`): the bounds first, then at most twice the plain PyTorch baseline's "
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
