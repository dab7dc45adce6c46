"""The CUDA-only sections: ``discipline`` (host syncs and allocations per forward, and the
``compile`` rows: ``torch.compile`` of each layer) and ``graphs`` (CUDA-graph replay after each
weight-change route). Their auditors are imported only on a GPU."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from magi_moe.config import preset
from magi_moe.layer import MagiMoE

from ..cache import draw_state
from magi_moe.verdict import not_declared, not_run, unsupported

from ..rows import FAIL, INFO, PASS, SKIP, Row
from .streaming import rows_as_found

if TYPE_CHECKING:
    from ..report import Audit


def discipline(audit: Audit) -> Iterator[Row]:
    from ..discipline import audit_compile, audit_discipline, audit_layer_discipline

    problem = audit.main_problem()
    for impl in audit.selected_impls():
        if audit.runnable_here(impl) or impl.is_oracle:
            continue
        why = impl.supports(problem.config)
        if why:
            yield Row("discipline", impl.name, SKIP, unsupported(f"unsupported: {why}"),
                      impl=impl.name)
            continue
        report = audit_discipline(impl, problem)
        declared = report.declares_no_host_sync
        status = (PASS if report.ok else FAIL) if declared else INFO
        yield Row("discipline", impl.name, status, report.summary().split(": ", 1)[1],
                  report.to_dict(), impl=impl.name,
                  skip=None if declared else not_declared("does not declare no_host_sync"))
    config = problem.config
    state = draw_state(config, audit.options.seed, audit.device)
    own_layer = lambda impl: impl.layer(config, state, audit.device)  # noqa: E731
    for impl in audit.selected_impls():
        if "no_host_sync" in impl.capabilities and not audit.runnable_here(impl):
            report = audit_layer_discipline(
                lambda impl=impl: own_layer(impl), num_tokens=problem.num_tokens,
                seed=audit.options.seed, label=f"{impl.name}.layer()", config=config)
            yield Row("discipline", report.label, PASS if report.ok else FAIL,
                      report.summary().split(": ", 1)[1], report.to_dict(), impl=impl.name)
    # label: (factory, the implementation judged; None for magi-moe's own layer)
    factories = {"MagiMoE(default dispatch)": (lambda: MagiMoE(config, device=audit.device), None)}
    for impl in audit.selected_impls():
        if "weight_cache" in impl.capabilities and not audit.runnable_here(impl):
            factories[f"{impl.name}.layer()"] = (lambda impl=impl: own_layer(impl), impl.name)
    for label, (factory, name) in factories.items():
        report = audit_compile(factory, label=label, seed=audit.options.seed, config=config)
        yield Row("compile", label, PASS if report.ok else FAIL, report.detail, impl=name,
                  clause="compile")


def graphs(audit: Audit) -> Iterator[Row]:
    """CUDA-graph replay after each weight-change route, on each implementation's own layer
    (:mod:`audit.graphs`): graph-safe, stale (a finding unless the layer promises a
    recapture, which must then work) or refused."""
    from ..graphs import audit_graph_replay

    config = preset("small")
    for impl in audit.selected_impls():
        why = audit.runnable_here(impl) or impl.supports(config)
        if why:
            yield Row("graphs", impl.name, SKIP, why)
            continue

        def row(r, impl=impl):
            # a layer whose forward cannot be captured at all is reported, not failed
            refused = r.detail.startswith("capture failed")
            status = INFO if refused else (PASS if r.ok else FAIL)
            result = f"{r.status} (promised {r.promised}): {r.detail}"
            return Row("graphs", f"{impl.name}: {r.route}/{r.parameter}", status, result,
                       r.to_dict(), impl=impl.name, clause=f"cuda-graph/{r.route}",
                       skip=not_run(f"cannot be captured: {result}") if refused else None)

        yield from rows_as_found(
            lambda on_result, impl=impl: audit_graph_replay(
                impl.layer, config, device=audit.device, seed=audit.options.seed,
                on_result=on_result),
            row)
