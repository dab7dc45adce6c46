"""The audit's routing section: each audited implementation's router (``impl.route``: its declared
``router``, else magi-moe's torch router) judged by :func:`audit.router_judge.judge_router_call`
on every router probe (:mod:`audit.router_probes`), with sigmoid and softmax scores, at each of
the audit's presets (moved inside the implementation's declared shapes). One row per
implementation, preset and score function: ``FAIL`` names the broken rules and the probe that
shows each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from magi_moe.config import preset
from magi_moe.verdict import unsupported

from ..router_judge import judge_router_call
from ..router_probes import ROUTER_PROBES, router_probe
from ..rows import FAIL, PASS, SKIP, Row

if TYPE_CHECKING:
    from ..report import Audit

SECTION = "routing"
MAX_TOKENS = 256  # the float64 router keeps [S, H, E] tensors; routing faults show at any S


def run(audit: Audit) -> Iterator[Row]:
    o = audit.options
    tokens = min(o.resolved_tokens(), MAX_TOKENS)
    for impl in audit.selected_impls():
        why = audit.runnable_here(impl)
        if why:
            yield Row(SECTION, impl.name, SKIP, why, impl=impl.name)
            continue
        for preset_name in o.resolved_presets():
            for score_func in ("sigmoid", "softmax"):
                subject = f"{impl.name}.route @ {preset_name}/{score_func}"
                config = impl.shapes.nearest(preset(preset_name).replace(score_func=score_func))
                why = impl.supports(config)
                if why:
                    yield Row(SECTION, subject, SKIP, unsupported(f"unsupported: {why}"),
                              impl=impl.name)
                    continue
                # head locality on the first and last head: each one is a rerun of the router
                heads = tuple(sorted({0, config.num_heads - 1}))
                failures, near_ties, data = [], 0, {}
                for probe in ROUTER_PROBES:
                    x, gate, bias = router_probe(probe, config, tokens, seed=o.seed, device=audit.device)
                    try:
                        verdict = judge_router_call(impl.route, x, gate, bias, config, heads=heads,
                                                    subject=f"{impl.name}.route")
                    except Exception as exc:  # noqa: BLE001 -- a crash is a finding
                        failures.append(f"{probe}: raised {type(exc).__name__}: {exc}")
                        continue
                    data[probe] = verdict.metrics
                    near_ties += verdict.near_ties
                    if not verdict.ok:
                        first = next(c for c in verdict.checks if not c.ok)
                        failures.append(f"{probe}: {', '.join(verdict.failed)} ({first.text})")
                if failures:
                    yield Row(SECTION, subject, FAIL, "; ".join(failures), data, impl=impl.name)
                else:
                    yield Row(SECTION, subject, PASS,
                              f"{len(ROUTER_PROBES)} probes x {tokens} tokens: choices, tie rule, NaN "
                              f"last, weights and head locality as the float64 router "
                              f"({near_ties} near-tie pairs within fp32 rounding)", data,
                              impl=impl.name)
