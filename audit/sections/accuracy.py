"""The ``bounds`` section: each implementation on each probe (:mod:`audit.probes`) at each of the
audit's presets, judged by :func:`magi_moe.judge.judge`: the error bounds first, then the
FlashAttention-style baseline ratio and faithfulness to its precision model's emulation."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from magi_moe.config import preset
from magi_moe.impls import BASELINE
from magi_moe.problems import run_poisoned

from magi_moe.judge.bounds import compute_error_bounds
from magi_moe.judge import judge
from ..probes import probe_problem
from magi_moe.verdict import unsupported

from ..rows import FAIL, PASS, SKIP, Row

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "bounds"


def run(audit: Audit) -> Iterator[Row]:
    """The bounds rows; the random problem of each preset becomes ``audit.problems`` (the
    determinism and discipline sections reuse it) once every preset is done."""
    random_problems = {}
    runnable = []
    for impl in audit.selected_impls():
        why = audit.runnable_here(impl)
        if why:
            yield Row(SECTION, impl.name, SKIP, why, impl=impl.name)
        else:
            runnable.append(impl)
    for preset_name in audit.options.resolved_presets():
        # each implementation at the preset, or at the nearest widths its shape rule accepts
        groups: dict = {}
        for impl in runnable:
            config = impl.shapes.nearest(preset(preset_name))
            why = impl.supports(config)
            if why:
                yield Row(SECTION, f"{impl.name} @ {preset_name}", SKIP,
                          unsupported(f"unsupported: {why}"), impl=impl.name)
                continue
            groups.setdefault(config, []).append(impl)
        for config, here in groups.items():
            label = preset_name if config == preset(preset_name) else (
                f"{preset_name}(Dh={config.head_dim},I={config.intermediate_size})")
            yield from _bounds_for(audit, config, label, here, random_problems)
    audit.problems.update(random_problems)


def _bounds_for(audit: Audit, config, label, here, random_problems) -> Iterator[Row]:
    o = audit.options
    models = {i.name: audit.model_for(i, config) for i in here}
    for probe in o.probes:
        problem = probe_problem(probe, config, o.resolved_tokens(), seed=o.seed,
                                device=audit.device)
        if probe == "random":
            random_problems.setdefault(label.split("(")[0], problem)
        bounds = compute_error_bounds(problem.x, problem.table, problem.weights, config,
                                      set(models.values()),
                                      failure_probability=o.failure_probability)
        base_out = run_poisoned(BASELINE, problem)
        for impl in here:
            yield _check_bounds(audit, impl, problem, bounds[models[impl.name].name], base_out,
                                label, probe)


def _check_bounds(audit: Audit, impl, problem, bounds, base_out, preset_name, probe) -> Row:
    subject = f"{impl.name} @ {preset_name}/{probe}"
    start = time.perf_counter()
    try:
        out = run_poisoned(impl, problem)
    except Exception as exc:  # noqa: BLE001 -- a crash is a finding
        return Row(SECTION, subject, FAIL, f"{type(exc).__name__}: {exc}", impl=impl.name)
    seconds = time.perf_counter() - start
    verdict = judge(out, problem, impl, bounds=bounds, baseline=base_out)
    report = verdict.bound_report
    data = {"judge": verdict.metrics, "text": verdict.text, "seconds": seconds,
            "preset": preset_name, "probe": probe}
    if report is None:  # not finite: the judge looked no further
        result = verdict.deciding.text
    else:
        audit.bound_reports.append((preset_name, probe, impl.name, report))
        data["bounds"] = report.to_dict()
        result = (f"{report.model}: err/bound max {report.worst_max_ratio:.3g} worst-case, "
                  f"{report.prob_max_ratio:.3g} probabilistic; rel L2 {report.relative_l2:.2e}")
        versus = verdict.check("baseline")  # absent for fp32 inputs (see magi_moe.judge)
        if versus is not None:
            result += f"; vs {BASELINE.name} {versus.figures['baseline_ratio']:.2f}x"
        faithful = verdict.check("faithfulness")
        if faithful is not None and "within_one_ulp" in faithful.figures:
            result += f"; {faithful.figures['within_one_ulp']:.2%} within one ulp of its emulation"
    if not verdict.ok:
        result += f" -- FAILED on {verdict.criterion}: {verdict.deciding.text}"
    return Row(SECTION, subject, PASS if verdict.ok else FAIL, result, data, impl=impl.name)
