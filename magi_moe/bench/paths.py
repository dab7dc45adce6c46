"""What the benchmark times: one record per path (:class:`BenchPath`), built from an
implementation's declaration, so magi-moe's own paths and an outside team's are the same kind of
thing; the zero-argument callable each path times; and each path's check before any timing.

An implementation ``NAME`` (a registered name or ``package.module:attr``) gives two paths:

* ``NAME``, kernel level: its ``forward`` on precomputed routes, on weights prepared once by its
  ``prepare_weights`` (packed, for ``fused``), into a pre-allocated output;
* ``NAME-layer``, layer level: its own layer (:meth:`Implementation.layer`), routing included.

Routers are paths too: ``routing`` is the contract's router (:func:`magi_moe.routing.route`
and the CSR sort), the one an implementation without a ``router`` of its own takes, and an
implementation that declares one gives ``NAME-routing`` (its ``route``: ``fused-routing`` is the
fused routing kernels). Routers are timed, not judged here (the audit and
``tests/test_router_conformance.py`` judge them)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from ..implementation import Implementation
from ..impls import BASELINE, BUILTINS
from ..problems import Problem, relative_l2
from ..registry import get_implementation
from ..routing import build_route_table, route

Level = Literal["kernel", "layer", "routing"]
LAYER_SUFFIX = "-layer"


ROUTING_SUFFIX = "-routing"
CONTRACT_ROUTING = "routing"


def _contract_routing(problem: Problem) -> Callable[[], torch.Tensor]:
    p = problem
    return lambda: build_route_table(route(p.x, p.gate, p.bias, p.config), p.config).offsets


def _declared_routing(impl: Implementation, problem: Problem) -> Callable[[], torch.Tensor]:
    p = problem
    return lambda: impl.route(p.x, p.gate, p.bias, p.config).probs


class KernelCall:
    """``impl.forward`` on precomputed routes and prepared weights into ``out``; ``out`` is kept
    so that the check can poison it first (an element left unwritten shows as NaN)."""

    def __init__(self, impl: Implementation, problem: Problem):
        p = problem
        self.impl, self.problem = impl, p
        self.weights = impl.prepare_weights(p.weights) if impl.prepare_weights else p.weights
        self.out = torch.empty(p.x.shape, dtype=impl.output_dtype(p.x.dtype), device=p.x.device)

    def __call__(self) -> torch.Tensor:
        p = self.problem
        return self.impl(p.x, p.table, self.weights, p.config, out=self.out)


class LayerCall:
    """``layer(x)`` as a path, without autograd (inference); keeps ``layer`` reachable for the
    compiled rows."""

    def __init__(self, layer: torch.nn.Module, x: torch.Tensor):
        self.layer, self.x = layer, x

    def __call__(self) -> torch.Tensor:
        with torch.no_grad():
            return self.layer(self.x)


def _layer(problem: Problem, impl: Implementation):
    """The implementation's own layer (:meth:`Implementation.layer`) loaded with the problem's
    weights; the selection bias is the problem's in both bias slots."""
    sd = {"gate": problem.gate, "W_gate": problem.weights.w_gate, "W_up": problem.weights.w_up,
          "W_down": problem.weights.w_down, "router.expert_bias": problem.bias,
          "router.expert_bias_ema": problem.bias}
    return impl.layer(problem.config, {k: v.clone() for k, v in sd.items()}, problem.x.device)


@dataclass(frozen=True)
class BenchPath:
    """One timed path: an implementation at kernel or layer level, or a router (an
    implementation's declared router, or the contract's with ``impl`` None)."""

    name: str
    level: Level
    impl: Implementation | None = None

    @property
    def plain_pytorch(self) -> bool:
        """Runs without Triton kernels (so on the CPU without the interpreter)."""
        if self.impl is None:
            return True
        return self.impl.plain_pytorch

    def cannot_run_on(self, device: torch.device) -> str | None:
        """Why this path cannot run on ``device``, or None (the implementation's own answer)."""
        if self.impl is None:
            return None
        return self.impl.skip_reason(device)

    def unsupported(self, problem: Problem) -> str | None:
        """Why the problem lies outside the implementation's declaration, or None."""
        if self.impl is None:
            return None
        return self.impl.supports(problem.config, problem.x.dtype)

    def build(self, problem: Problem) -> Callable[[], torch.Tensor]:
        """The zero-argument callable, with every piece of state (output, prepared weights,
        layer) built here, so that the timed call does only the path's own work."""
        if self.level == "routing":
            return (_contract_routing(problem) if self.impl is None
                    else _declared_routing(self.impl, problem))
        if self.level == "kernel":
            return KernelCall(self.impl, problem)
        return LayerCall(_layer(problem, self.impl), problem.x)

    def judged_problem(self, problem: Problem) -> Problem:
        """The problem on the routes this path computes: the drawn table at kernel level; at
        layer level the routes of the implementation's own router (its declared ``router``, else
        magi-moe's torch router), which its layer takes."""
        if self.level != "layer" or self.impl is None or self.impl.router is None:
            return problem
        routes = self.impl.route(problem.x, problem.gate, problem.bias, problem.config)
        return dataclasses.replace(problem, routes=routes,
                                   table=build_route_table(routes, problem.config))


def paths_of(impl: Implementation) -> tuple[BenchPath, BenchPath]:
    """An implementation's two paths: kernel level (``NAME``) and layer level (``NAME-layer``)."""
    return BenchPath(impl.name, "kernel", impl), BenchPath(impl.name + LAYER_SUFFIX, "layer", impl)


def routing_path_of(impl: Implementation) -> BenchPath | None:
    """``NAME-routing``, the implementation's declared router, or None where it declares none."""
    return None if impl.router is None else BenchPath(impl.name + ROUTING_SUFFIX, "routing", impl)


# magi-moe's own paths: every built-in implementation but the float64 oracle, at both levels
BUILTIN_PATHS: dict[str, BenchPath] = {
    **{p.name: p for impl in BUILTINS if not impl.is_oracle for p in paths_of(impl)},
    CONTRACT_ROUTING: BenchPath(CONTRACT_ROUTING, "routing"),
    **{p.name: p for p in map(routing_path_of, BUILTINS) if p is not None}}
ROUTING_PATHS = tuple(n for n, p in BUILTIN_PATHS.items() if p.level == "routing")
ALL_PATHS = tuple(BUILTIN_PATHS)
DEFAULT_PATHS = ("native", "native-det", "fused", "fused-layer")
# Beside an outside implementation (--impl): the fused path at both levels and the plain PyTorch
# baseline at both levels
COMPARED_PATHS = ("fused", "fused-layer", BASELINE.name, BASELINE.name + LAYER_SUFFIX)


def resolve(name: str) -> BenchPath:
    """The path called ``name``: ``routing``, ``IMPL-routing``, ``IMPL-layer`` or ``IMPL`` for a registered
    implementation (``IMPL`` may be ``package.module:attr``); ValueError otherwise."""
    if name in BUILTIN_PATHS:
        return BUILTIN_PATHS[name]
    if name.endswith(LAYER_SUFFIX):
        try:
            return paths_of(get_implementation(name.removesuffix(LAYER_SUFFIX)))[1]
        except ValueError:
            pass
    if name.endswith(ROUTING_SUFFIX):
        try:
            routing = routing_path_of(get_implementation(name.removesuffix(ROUTING_SUFFIX)))
        except ValueError:
            routing = None
        if routing is not None:
            return routing
    try:
        impl = get_implementation(name)
    except (ValueError, TypeError):
        raise ValueError(f"paths must be among {','.join(ALL_PATHS)}, IMPL or IMPL-layer for a "
                         f"registered or --impl implementation, got {name!r}") from None
    if impl.is_oracle:
        raise ValueError(f"path {name!r} is the float64 oracle, the reference every path is "
                         f"checked against, not a path to time")
    return paths_of(impl)[0]


def make_paths(problem: Problem, names) -> dict[str, Callable[[], torch.Tensor]]:
    """One zero-argument callable per path (names or :class:`BenchPath` records)."""
    records = [n if isinstance(n, BenchPath) else resolve(n) for n in names]
    return {r.name: r.build(problem) for r in records}


def check_path(path: BenchPath, problem: Problem, fn: Callable[[], torch.Tensor],
               baseline: torch.Tensor | None = None) -> dict:
    """Judge one call of ``fn`` before any timing: :func:`magi_moe.judge.judge` under the
    implementation's declared precision model on the routes the path computes, with the relative
    L2 and largest error against float64. ``status`` is ``ok`` or ``WRONG`` (with ``why``); for
    layer paths whose router picks other experts than magi-moe's torch router, the mismatched
    (token, head) pairs are counted (a near-tie differs at fp32 rounding)."""
    from ..judge.bounds import problem_bounds
    from ..judge import judge

    impl = path.impl
    judged = path.judged_problem(problem)
    if isinstance(fn, KernelCall):  # poisoned: an element the implementation skips shows as NaN
        fn.out.fill_(float("nan"))
    got = fn()
    broken = broken_output(fn, got, problem.x)
    if broken:  # nothing to judge: the harness would time a call whose output nobody reads
        return {"level": path.level, "status": "WRONG", "why": broken, "rel_l2": None}
    out = got.detach().clone()
    bounds = problem_bounds(judged, impl.precision_for(judged.config))
    verdict = judge(out, judged, impl, bounds=bounds,
                    baseline=baseline if judged is problem else None)
    ref = bounds.reference
    entry: dict = {"level": path.level, "status": "ok" if verdict.ok else "WRONG",
                   "criterion": verdict.criterion, "rel_l2": relative_l2(out, ref),
                   "max_abs": float((out.double() - ref).abs().max()) if out.numel() else 0.0,
                   "nan": bool(torch.isnan(out).any())}
    if not verdict.ok:
        entry["why"] = verdict.text
    if judged is not problem:
        entry.update(_route_mismatches(judged, problem))
    return entry


def broken_output(fn: Callable[[], object], got: object, x: torch.Tensor) -> str | None:
    """Why what a path returned breaks the calling convention, or None. Kernel level: ``forward``
    writes the caller's ``out`` and returns it (a new tensor leaves ``out``, which the caller
    reads, unwritten: still NaN here). Layer level: ``[S, H*Dh]`` in ``x``'s dtype."""
    if isinstance(fn, KernelCall):
        want = fn.out
        if not isinstance(got, torch.Tensor):
            return f"forward returned {type(got).__name__}, not out"
        unwritten = int(torch.isnan(want).sum())
        if got.data_ptr() != want.data_ptr() or got.shape != want.shape or got.dtype != want.dtype:
            return (f"forward returned a new {str(got.dtype).removeprefix('torch.')} tensor of shape "
                    f"{tuple(got.shape)} instead of out ({str(want.dtype).removeprefix('torch.')}, "
                    f"{tuple(want.shape)}); {unwritten} of out's {want.numel()} elements left unwritten")
        return None
    if not isinstance(got, torch.Tensor):
        return f"the layer returned {type(got).__name__}, not a tensor"
    if got.shape != x.shape or got.dtype != x.dtype:
        return (f"the layer returned {str(got.dtype).removeprefix('torch.')} {tuple(got.shape)}, "
                f"expected {str(x.dtype).removeprefix('torch.')} {tuple(x.shape)} (x's dtype and shape)")
    return None


def _route_mismatches(judged: Problem, problem: Problem) -> dict:
    """Pairs whose experts differ from the torch router's, with the largest float64 selection
    score gap among them."""
    from ..routing import router_logits, scores_from_logits

    cfg = problem.config
    ids, torch_ids = judged.routes.expert_ids.long(), problem.routes.expert_ids.long()
    differ = (ids != torch_ids).any(-1)
    entry = {"route_mismatches": int(differ.sum())}
    if entry["route_mismatches"]:
        sel = scores_from_logits(router_logits(problem.x, problem.gate, cfg, torch.float64),
                                 cfg.score_func) + problem.bias.view(cfg.num_heads, -1).double()
        gap = torch.gather(sel, -1, ids).sum(-1) - torch.gather(sel, -1, torch_ids).sum(-1)
        entry["max_mismatch_gap"] = float(gap[differ].abs().max())
    return entry


def check_paths(problem: Problem, paths: list[BenchPath],
                fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, dict]:
    """Every implementation path judged on ``problem`` (routing paths are not judged); a path whose
    check raises is reported as ``error`` with the exception. The plain PyTorch baseline's
    output, which the judge compares with, is computed once per problem."""
    report: dict[str, dict] = {}
    baseline = None
    for path in paths:
        if path.level == "routing":
            continue
        if baseline is None:
            p = problem
            baseline = BASELINE(p.x, p.table, p.weights, p.config)
        try:
            report[path.name] = check_path(path, problem, fns[path.name], baseline)
        except Exception as exc:  # noqa: BLE001 -- reported in the table, never timed
            report[path.name] = {"level": path.level, "status": "error",
                                 "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return report
