"""``python -m magi_moe.benchmark``: the expert paths timed side by side, with their floors.

For every case (heads x tokens; the four cases of docs/ANCHORS.md with ``--anchors``) this draws a
problem as :func:`magi_moe.problems.random_problem` does (x N(0,1), router N(0, 0.25^2),
selection bias N(0, 0.05^2), weights N(0, 0.02^2); drawn on the device so that 12 x 256 experts
take milliseconds), checks every path against the float64 reference on the same routes, and
only then times them:

* CUDA events around each call; the L2 cache flushed before every call by zeroing a buffer of
  ``--flush-mib`` (>= 256 MiB; the H200's L2 is 60 MB); paths alternated inside every iteration
  (the order rotating), so clock drift and thermal state hit them alike;
* median and p90 over ``--iters`` per round, the best round's median reported;
* bytes and FLOPs with docs/ANCHORS.md's floors: memory = weights of the experts that received a
  route + x + y over 4281 GB/s; compute = routes * (2*Dh*I*2 + 2*I*Dh) over 793 TFLOP/s.

Paths: ``native``, ``native-det`` (the native kernel, atomic / deterministic), ``fused`` (kernel
level: routes precomputed, weights packed, workspace warm), ``fused-layer`` and ``native-layer``
(``MagiMoE.forward``: routing included), ``routing`` (torch router + CSR sort) and
``fused-routing``, ``torch-bf16`` (the plain per-expert loop; slow).

``--sweep`` times the fused kernels' tile candidates per case and writes the winners into
``magi_moe/kernels/tiles/fused.json`` through the function the loader reads.

``--json PATH`` writes everything measured. With ``--device cpu`` (and ``TRITON_INTERPRET=1``
for the kernel paths) it runs small cases with host timers, as a smoke test of the harness.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .config import MoEConfig, preset
from .implementation import Implementation
from .registry import get_implementation
from .problems import Problem, random_problem, relative_l2
from .reference import expert_reference
from .routing import build_route_table, route
from .text_tables import format_table as text_table
from .weights import ExpertWeights

COPY_GBPS = 4281.0      # docs/ANCHORS.md: device-to-device copy on the H200, bytes read + written
MATMUL_TFLOPS = 793.0   # docs/ANCHORS.md: 8192^3 bf16 matmul on the H200
ANCHOR_CASES = ((3, 512), (3, 4096), (3, 16384), (12, 4096))
EXPERT_PATHS = ("native", "native-det", "fused", "torch-bf16")
LAYER_PATHS = ("fused-layer", "native-layer")
ROUTING_PATHS = ("routing", "fused-routing")
ALL_PATHS = EXPERT_PATHS + LAYER_PATHS + ROUTING_PATHS
DEFAULT_PATHS = ("native", "native-det", "fused", "fused-layer")


# Routing draws (router weight std): "anchors" is docs/ANCHORS.md's (std 1/16, logits std 1:
# 89-98% of experts routed, busiest 6-9x the mean), the one the public figures use;
# "concentrated" (std 0.25, logits std 4) routes to about a third of the experts, as a
# checkpoint whose router concentrates would: it reads a third of the weight bytes.
DRAWS = {"anchors": 1.0 / 16, "concentrated": 0.25}


@dataclass(frozen=True)
class BenchCase:
    heads: int
    tokens: int
    experts: int = 256
    top_k: int = 6
    head_dim: int = 256
    inter: int = 1280
    seed: int = 0
    draw: str = "anchors"

    def __post_init__(self) -> None:
        if self.draw not in DRAWS:
            raise ValueError(f"BenchCase.draw must be one of {sorted(DRAWS)}, got {self.draw!r}")

    def config(self) -> MoEConfig:
        return preset("magi2-full").replace(num_heads=self.heads, num_experts=self.experts,
                                            top_k=self.top_k, head_dim=self.head_dim,
                                            intermediate_size=self.inter)

    @property
    def label(self) -> str:
        suffix = "" if self.draw == "anchors" else f" ({self.draw})"
        return f"H={self.heads},S={self.tokens}{suffix}"


def draw_problem(case: BenchCase, device: torch.device) -> Problem:
    """x N(0,1), weights N(0, 0.02^2), bias N(0, 0.05^2), router weights N(0, std^2) with the
    case's named draw (:data:`DRAWS`), drawn on ``device`` (CPU draws go through random_problem)."""
    cfg = case.config()
    gate_std = DRAWS[case.draw]
    if device.type != "cuda":
        return random_problem(cfg, case.tokens, seed=case.seed, device=device, gate_std=gate_std)
    gen = torch.Generator(device=device).manual_seed(case.seed)

    def randn(*shape, std=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    HE, Dh, I = cfg.num_banks, cfg.head_dim, cfg.intermediate_size
    x = randn(case.tokens, cfg.hidden_size, dtype=cfg.dtype)
    gate = randn(HE, Dh, std=gate_std)
    bias = randn(HE, std=0.05)
    weights = ExpertWeights(randn(HE, Dh, I, std=0.02, dtype=cfg.dtype),
                            randn(HE, Dh, I, std=0.02, dtype=cfg.dtype),
                            randn(HE, I, Dh, std=0.02, dtype=cfg.dtype))
    routes = route(x, gate, bias, cfg)
    return Problem(cfg, x, gate, bias, weights, routes, build_route_table(routes, cfg))


def floors(problem: Problem) -> dict:
    """docs/ANCHORS.md's floors for this problem (synchronises: call before timing)."""
    cfg = problem.config
    counts = problem.table.counts()
    routed_banks = int((counts > 0).sum())
    R = problem.table.num_routes
    Dh, I = cfg.head_dim, cfg.intermediate_size
    elem = torch.finfo(cfg.dtype).bits // 8
    weight_bytes = routed_banks * 3 * Dh * I * elem
    io_bytes = 2 * problem.x.numel() * elem
    flops = R * (2 * Dh * I * 2 + 2 * I * Dh)
    mem_ms = (weight_bytes + io_bytes) / (COPY_GBPS * 1e9) * 1e3
    compute_ms = flops / (MATMUL_TFLOPS * 1e12) * 1e3
    busiest = int(counts.max()) if counts.numel() else 0
    return {"routes": R, "routed_banks": routed_banks, "banks": cfg.num_banks,
            "max_routes_per_bank": busiest,
            "busiest_over_mean": busiest / (R / cfg.num_banks) if R else 0.0,
            "bytes": weight_bytes + io_bytes, "flops": flops,
            "memory_floor_ms": mem_ms, "compute_floor_ms": compute_ms,
            "floor_ms": max(mem_ms, compute_ms)}


# ---------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------
def _layer(problem: Problem, impl: Implementation):
    """The implementation's own layer (:meth:`Implementation.layer`) loaded with the problem's
    weights; the selection bias is the problem's in both bias slots."""
    sd = {"gate": problem.gate, "W_gate": problem.weights.w_gate, "W_up": problem.weights.w_up,
          "W_down": problem.weights.w_down, "router.expert_bias": problem.bias,
          "router.expert_bias_ema": problem.bias}
    return impl.layer(problem.config, {k: v.clone() for k, v in sd.items()}, problem.x.device)


def _expert_path(problem: Problem, impl: Implementation, out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Kernel level: routes precomputed, weights prepared once as the implementation declares
    (packed for ``fused``), the output pre-allocated."""
    p = problem
    weights = impl.prepare_weights(p.weights) if impl.prepare_weights else p.weights
    out = out if impl.output_dtype(p.x.dtype) == out.dtype else torch.empty_like(
        out, dtype=impl.output_dtype(p.x.dtype))
    return lambda: impl(p.x, p.table, weights, p.config, out=out)


def make_paths(problem: Problem, names: tuple[str, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """One zero-argument callable per path, all state (outputs, packed weights, layers) built
    here so that the timed call does only the path's own work. An expert path is named by its
    implementation; ``NAME-layer`` is that implementation's own layer (routing included)."""
    from .kernels.fused_routing import fused_route

    p, cfg = problem, problem.config
    x = p.x
    out = torch.empty_like(x)
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for name in names:
        if name in EXPERT_PATHS:
            fns[name] = _expert_path(p, get_implementation(name), out)
        elif name in LAYER_PATHS:
            layer = _layer(p, get_implementation(name.removesuffix("-layer")))
            fns[name] = lambda layer=layer: layer(x)
        elif name == "routing":
            fns[name] = lambda: build_route_table(route(x, p.gate, p.bias, cfg), cfg).offsets
        elif name == "fused-routing":
            fns[name] = lambda: fused_route(x, p.gate, p.bias, cfg, block_m=64).table.offsets
        else:
            raise ValueError(f"paths must be among {ALL_PATHS}, got {name!r}")
    return fns


def parity(problem: Problem, fns: dict[str, Callable[[], torch.Tensor]]) -> dict[str, dict]:
    """Relative L2 error of every expert/layer path against float64 on the routes it used: the
    problem's table for kernel-level paths and the torch-routed layer, the fused router's own
    table for ``fused-layer`` (whose route differences from the torch router are counted, with
    the largest float64 selection-score gap among them: a near-tie is a gap at fp32 rounding)."""
    from .kernels.fused_routing import fused_route
    from .routing import router_logits, scores_from_logits

    p, cfg = problem, problem.config
    ref = expert_reference(p.x, p.table, p.weights, cfg, precision="float64")
    report: dict[str, dict] = {"reference_rms": float(ref.pow(2).mean().sqrt())}
    for name, fn in fns.items():
        if name in ROUTING_PATHS:
            continue
        out = fn().clone()
        want = ref
        entry: dict = {}
        if name == "fused-layer":
            routes = fused_route(p.x, p.gate, p.bias, cfg)
            want = expert_reference(p.x, routes.table, p.weights, cfg, precision="float64")
            ids, torch_ids = routes.expert_ids.long(), p.routes.expert_ids
            differ = (ids != torch_ids).any(-1)
            entry["route_mismatches"] = int(differ.sum())
            if entry["route_mismatches"]:
                sel = scores_from_logits(router_logits(p.x, p.gate, cfg, torch.float64),
                                         cfg.score_func) + p.bias.view(cfg.num_heads, -1).double()
                picked = torch.gather(sel, -1, ids).sum(-1)
                torch_picked = torch.gather(sel, -1, torch_ids).sum(-1)
                entry["max_mismatch_gap"] = float((picked - torch_picked)[differ].abs().max())
        entry.update(rel_l2=relative_l2(out, want), max_abs=float((out.double() - want).abs().max()),
                     nan=bool(torch.isnan(out).any()))
        report[name] = entry
    return report


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def time_paths(fns: dict[str, Callable[[], object]], *, warmup: int, iters: int,
               flush_mib: int, device: torch.device) -> dict[str, list[float]]:
    """Per-call milliseconds of every path, alternated, with the L2 flushed before each call."""
    names = list(fns)
    cuda = device.type == "cuda"
    flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device=device) if cuda else None
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    if cuda:
        torch.cuda.synchronize(device)
        events = {n: [] for n in names}
        for i in range(iters):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize(device)
        for name in names:
            times[name] = [s.elapsed_time(e) for s, e in events[name]]
    else:
        for i in range(iters):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                t0 = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def summarize(samples: list[float]) -> dict:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"median_ms": statistics.median(ordered), "p90_ms": p90, "min_ms": ordered[0],
            "mean_ms": statistics.fmean(ordered), "n": len(ordered)}


def run_case(case: BenchCase, paths: tuple[str, ...], *, device: torch.device, warmup: int,
             iters: int, rounds: int, flush_mib: int) -> dict:
    problem = draw_problem(case, device)
    fl = floors(problem)
    fns = make_paths(problem, paths)
    checks = parity(problem, fns)
    best: dict[str, dict] = {}
    for _ in range(rounds):
        times = time_paths(fns, warmup=warmup, iters=iters, flush_mib=flush_mib, device=device)
        for name, samples in times.items():
            stats = summarize(samples)
            if name not in best or stats["median_ms"] < best[name]["median_ms"]:
                best[name] = stats
    for name, stats in best.items():
        stats["x_floor"] = stats["median_ms"] / fl["floor_ms"] if fl["floor_ms"] else None
        if name not in ROUTING_PATHS:
            stats["tflops"] = fl["flops"] / (stats["median_ms"] * 1e-3) / 1e12
    return {"case": asdict(case), "label": case.label, "floors": fl, "parity": checks,
            "timings": best}


# ---------------------------------------------------------------------------------------------
# tile sweep
# ---------------------------------------------------------------------------------------------
# Gate/up candidates as FusedTiles fields, each with the programs per SM to try: "kloop" loops
# over Dh per column tile, "tma_gathered" loads tiles by tensor descriptor (kernels/fused_tma.py).
# Earlier versions (NOTES-perf.md) also tried flattened loops, "wide" kernels that loaded a
# block's x rows once (pointer and descriptor forms), BK=16, 64x256 tiles, register caps and
# Triton's warp specialisation (wrong outputs on Triton 3.6): slower or wrong, dropped.
def _gu(variant, bm, bn, bk, warps, stages, ppsm=(1, 2), act="ptr"):
    tiles = dict(gu_variant=variant, block_m=bm, gu_block_n=bn, gu_block_k=bk, gu_warps=warps,
                 gu_stages=stages, gu_act_store=act)
    return [{**tiles, "gu_programs_per_sm": p} for p in ppsm]


def _dn(bm, bn, bk, warps, stages, ppsm=(1, 2), variant="ptr"):
    return [dict(block_m=bm, down_block_n=bn, down_block_k=bk, down_warps=warps,
                 down_stages=stages, down_programs_per_sm=p, down_variant=variant) for p in ppsm]


GATE_UP_CANDIDATES = tuple(c for group in (
    # version 3's winner (pointer loads): each block size's first candidate is the reference
    # the others are checked against
    _gu("kloop", 64, 128, 32, 4, 5, (2,)),
    _gu("kloop", 128, 128, 32, 8, 4, (1,)),
    # both operands by descriptor, x rows gathered first (version 4's winner first)
    _gu("tma_gathered", 64, 128, 32, 4, 5, (2,)),
    _gu("tma_gathered", 64, 128, 32, 4, 4, (2,), act="tma"),
    _gu("tma_gathered", 64, 128, 32, 8, 5, (2,)),  # two warpgroups share the epilogue
    _gu("tma_gathered", 64, 64, 32, 4, 5, (3, 4)), _gu("tma_gathered", 64, 64, 64, 4, 3, (3, 4)),
    _gu("tma_gathered", 128, 128, 32, 8, 4, (1,)),
) for c in group)
# Gate/up and down in one work item ("mlp_tma"): timed against the best gate/up + down pair.
MLP_CANDIDATES = tuple(c for group in (
    _gu("mlp_tma", 64, 32, 256, 4, 3, (1,)), _gu("mlp_tma", 64, 32, 256, 4, 4, (1,)),
    _gu("mlp_tma", 64, 16, 256, 4, 4, (1,)),
    # two warpgroups, one per 64 rows: the activation stays in the warpgroup that made it
    _gu("mlp_tma", 128, 32, 256, 8, 3, (1,)), _gu("mlp_tma", 128, 32, 256, 8, 2, (1,)),
    _gu("mlp_tma", 128, 16, 256, 8, 4, (1,)),
) for c in group)
DOWN_CANDIDATES = tuple(c for group in (
    _dn(64, 128, 64, 4, 4, (2,)), _dn(128, 256, 64, 8, 3, (1,)),
    _dn(64, 128, 64, 4, 4, (2,), variant="tma"), _dn(128, 256, 64, 8, 3, (1,), variant="tma"),
) for c in group)
SUM_CANDIDATES = ((8, 4), (16, 4), (32, 4), (32, 8))
ROUTING_CANDIDATES = (  # (block_s, block_d, warps, place_warps)
    (16, 64, 4, 4), (32, 64, 4, 4), (32, 64, 8, 8), (64, 64, 8, 8), (16, 32, 4, 4), (32, 32, 8, 4),
)


def _time_one(fn: Callable[[], object], *, warmup: int, iters: int, flush_mib: int,
              device: torch.device) -> float:
    return summarize(time_paths({"k": fn}, warmup=warmup, iters=iters, flush_mib=flush_mib,
                                device=device)["k"])["median_ms"]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> bool:
    """Same values up to summation order: no NaN, relative L2 difference below ``rtol``."""
    if bool(torch.isnan(got).any()):
        return False
    denom = float(want.double().norm()) or 1.0
    return float((got.double() - want.double()).norm()) / denom <= rtol


def sweep_case(problem: Problem, *, warmup: int, iters: int, flush_mib: int,
               routing: bool = True) -> dict:
    """Median ms of every candidate of each fused kernel on this problem. Each candidate's
    output is checked against the first candidate of its block size (NaN-poisoned first); a
    candidate that fails to compile, launch or agree, or whose launch plan falls back to
    another kernel here (timing a launch that did not happen would look fast), is recorded with
    ``ms: None``."""
    from .kernels import fused_routing as FR
    from .kernels import fused_tma as T
    from .kernels import plan as P
    from .kernels.device import device_facts
    from .kernels.fused import FusedCall, compiled_shared_memory, run_plan
    from .kernels.schedule import launch_block_schedule
    from .kernels.tiles import FusedTiles, RoutingTiles
    from .kernels.workspace import FusedWorkspace
    from .packed_weights import pack_expert_weights

    cfg, table, device = problem.config, problem.table, problem.x.device
    packed = pack_expert_weights(problem.weights)
    ws = FusedWorkspace(device)
    R, S = table.num_routes, problem.num_tokens
    rows = torch.empty(R, cfg.head_dim, dtype=torch.float32, device=device)
    slot_route = torch.empty(S * cfg.num_heads * cfg.top_k, dtype=torch.int32, device=device)
    out = torch.empty_like(problem.x)
    facts = device_facts(device)
    timing = dict(warmup=warmup, iters=iters, flush_mib=flush_mib, device=device)
    results: dict = {"gate_up": [], "down": [], "mlp": [], "sum": [], "routing": [],
                      "schedule": {}, "gather": {}}

    def attempt(kernel, tiles, launch, check):
        try:
            launch()
            ok = check()
            ms = _time_one(launch, **timing) if ok else None
            error = None if ok else "output disagrees"
        except Exception as exc:  # out of resources, compile errors: record and go on
            ms, error = None, f"{type(exc).__name__}: {exc}"[:300]
        results[kernel].append({"tiles": tiles, "ms": ms, **({"error": error} if error else {})})
        if error:
            print(f"  {kernel} {tiles}: {error[:160]}", flush=True)

    def steps(call, tiles, *kernels):
        """The launches of ``kernels`` that ``tiles`` plan here; an error where the plan falls
        back, so a candidate is timed only as itself."""
        plan = P.plan_fused(cfg, S, R, tiles, facts, packed, schedule_built=True,
                            shared_memory_of=compiled_shared_memory(call)
                            if device.type == "cuda" else None)
        if plan.reasons:
            raise RuntimeError("cannot run here: " + "; ".join(plan.reasons))
        part = plan.only(*kernels)
        return lambda: run_plan(part, call)

    for bm in sorted({c["block_m"] for c in GATE_UP_CANDIDATES}):
        sched = launch_block_schedule(table.offsets, R, cfg.num_banks, bm, ws)
        results["schedule"][bm] = _time_one(
            lambda: launch_block_schedule(table.offsets, R, cfg.num_banks, bm, ws), **timing)
        live = int(sched.block_count) * bm
        xg = ws.get("x_gathered", (sched.max_blocks * bm, cfg.head_dim), problem.x.dtype)
        results["gather"][bm] = _time_one(  # part of every "tma_gathered" time: shown apart
            lambda: T.launch_gather_rows(problem.x, table, sched, xg, cfg), **timing)
        act = torch.empty(sched.max_blocks * bm, cfg.intermediate_size, dtype=cfg.dtype,
                          device=device)
        call = FusedCall(problem.x, table, packed, cfg, ws, sched, rows, slot_route, out, act)
        want_act = None
        for cand in (c for c in GATE_UP_CANDIDATES if c["block_m"] == bm):
            tiles = FusedTiles(**cand).fitted(cfg)
            launch = None

            def gate_up():
                nonlocal launch
                launch = launch or steps(call, tiles, P.GATHER_ROWS, P.GATE_UP, P.GATE_UP_TMA)
                launch()

            def check():
                nonlocal want_act
                got = act[:live].clone()
                act.fill_(float("nan"))
                gate_up()
                if want_act is None:
                    want_act = act[:live].clone()
                return _close(act[:live], want_act, 2e-3) and _close(got, want_act, 2e-3)
            attempt("gate_up", cand, gate_up, check)
        want_rows = None
        for cand in (c for c in DOWN_CANDIDATES if c["block_m"] == bm):
            tiles = FusedTiles(**cand).fitted(cfg)
            launch = None

            def down():
                nonlocal launch
                launch = launch or steps(call, tiles, P.DOWN, P.DOWN_TMA)
                launch()

            def check():
                nonlocal want_rows
                rows.fill_(float("nan"))
                down()
                if want_rows is None:
                    want_rows = rows.clone()
                return _close(rows, want_rows, 1e-5)
            attempt("down", cand, down, check)
        for cand in (c for c in MLP_CANDIDATES if c["block_m"] == bm):
            tiles = FusedTiles(**cand).fitted(cfg)
            launch = None

            def mlp():
                nonlocal launch
                launch = launch or steps(call, tiles, P.EXPERT_MLP)
                launch()

            def check():
                rows.fill_(float("nan"))
                mlp()
                return want_rows is not None and _close(rows, want_rows, 1e-5)
            attempt("mlp", cand, mlp, check)
    for bt, warps in SUM_CANDIDATES:
        tiles = FusedTiles(sum_block_t=bt, sum_warps=warps)
        attempt("sum", {"sum_block_t": bt, "sum_warps": warps},
                steps(call, tiles, P.TOPK_SUM), lambda: True)
    want_ids = None
    for bs, bd, warps, pwarps in (ROUTING_CANDIDATES if routing else ()):
        rt = RoutingTiles(block_s=bs, block_d=bd, warps=warps, place_warps=pwarps)

        def route_once():
            return FR.fused_route(problem.x, problem.gate, problem.bias, cfg, block_m=64,
                                  workspace=ws, tiles=rt)

        def check():  # the same tables, but for a near-tie flipped by the summation order
            nonlocal want_ids
            fr = route_once()
            if want_ids is None:
                want_ids = fr.table.route_slots.clone()
            return float((fr.table.route_slots == want_ids).double().mean()) >= 0.999
        attempt("routing", {"block_s": bs, "block_d": bd, "warps": warps, "place_warps": pwarps},
                route_once, check)
    return results


def _key(tiles: dict) -> tuple:
    return tuple(sorted(tiles.items()))


def _normalised(sweeps: list[dict], kernel: str) -> dict[tuple, float]:
    """Per candidate: the sum over cases of its time over that case's fastest candidate;
    candidates that failed in any case are dropped."""
    scores: dict[tuple, float] = {}
    failed: set[tuple] = set()
    for sweep in sweeps:
        ok = [e["ms"] for e in sweep[kernel] if e["ms"] is not None]
        fastest = min(ok) if ok else 1.0
        for e in sweep[kernel]:
            key = _key(e["tiles"])
            if e["ms"] is None:
                failed.add(key)
            else:
                scores[key] = scores.get(key, 0.0) + e["ms"] / fastest
    return {k: v for k, v in scores.items() if k not in failed}


def _ms(sweep: dict, kernel: str, key: tuple) -> float:
    return next(e["ms"] for e in sweep[kernel] if _key(e["tiles"]) == key)


def best_tiles(sweeps: list[dict]):
    """The FusedTiles that minimise the time over the given cases' sweeps: per block_m the best
    gate/up and down candidates (by normalised time), then the block_m with the least total."""
    from .kernels.tiles import FusedTiles

    gu, dn, sm = (_normalised(sweeps, k) for k in ("gate_up", "down", "sum"))
    mlp = _normalised(sweeps, "mlp") if all("mlp" in s for s in sweeps) else {}
    best = None
    for bm in sorted({dict(k)["block_m"] for k in gu} & {dict(k)["block_m"] for k in dn}):
        g = min((v, k) for k, v in gu.items() if dict(k)["block_m"] == bm)[1]
        d = min((v, k) for k, v in dn.items() if dict(k)["block_m"] == bm)[1]
        total = sum(_ms(s, "gate_up", g) + _ms(s, "down", d) for s in sweeps)
        if best is None or total < best[0]:
            best = (total, g, d)
    for m in mlp:  # one kernel for both GEMMs: its time against the best pair's
        total = sum(_ms(s, "mlp", m) for s in sweeps)
        if total < best[0]:
            best = (total, m, ())
    _, g, d = best
    st = min((v, k) for k, v in sm.items())[1]
    return FusedTiles(**{**dict(g), **dict(d), **dict(st)})


def best_routing(sweeps: list[dict]) -> dict:
    scores = _normalised(sweeps, "routing")
    return dict(min((v, k) for k, v in scores.items())[1])


def merged_classes(swept: list[tuple[float, object]], device_name: str, path=None):
    """The GPU's tabled classes with the swept ones put in: each swept group (routes per bank,
    tiles) replaces the tiles of the tabled class it falls in; edges and other classes stay.
    None when the GPU has no table yet."""
    from .kernels.tiles import load_tile_table

    tabled = load_tile_table(device_name, path)
    if not tabled:
        return None
    classes = list(tabled)
    for centre, tiles in swept:
        i = next(i for i, (edge, _) in enumerate(classes) if centre <= edge)
        classes[i] = (classes[i][0], tiles)
    return classes


def run_sweep(cases: list[BenchCase], *, device: torch.device, warmup: int, iters: int,
              flush_mib: int, write: bool, merge: bool = False) -> dict:
    """Sweep every case, group the cases by routes per bank, write the winners per group
    (``merge``: into the tabled classes they fall in, keeping the rest of the table)."""
    from .kernels.tiles import load_device_entry, write_tile_table

    per_case = {}
    for case in cases:
        problem = draw_problem(case, device)
        t0 = time.time()
        per_case[case.label] = {"routes_per_bank": problem.table.num_routes / problem.config.num_banks,
                                "sweep": sweep_case(problem, warmup=warmup, iters=iters,
                                                    flush_mib=flush_mib, routing=not merge)}
        print(f"swept {case.label} in {time.time() - t0:.1f} s", flush=True)
        del problem
    # Classes: cases with the same routes per bank share tiles; edges at geometric midpoints.
    groups: dict[float, list[dict]] = {}
    for entry in per_case.values():
        groups.setdefault(round(entry["routes_per_bank"], 3), []).append(entry["sweep"])
    centres = sorted(groups)
    classes = []
    for i, c in enumerate(centres):
        edge = math.sqrt(c * centres[i + 1]) if i + 1 < len(centres) else None
        classes.append((edge, best_tiles(groups[c])))
    routing = best_routing([e["sweep"] for e in per_case.values()]) if not merge else None
    if merge and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tabled = merged_classes([(c, best_tiles(groups[c])) for c in centres], name)
        if tabled is not None:
            classes = [(None if math.isinf(edge) else edge, tiles) for edge, tiles in tabled]
            routing = (load_device_entry(name) or {}).get("routing", routing)
    summary = {"per_case": per_case, "routing": routing,
               "classes": [{"max_routes_per_bank": e, "tiles": asdict(t)} for e, t in classes]}
    if write and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        match = "H200" if "H200" in name else name
        path = write_tile_table(match, classes, routing=routing,
                                note=f"swept on {name} by magi_moe.benchmark --sweep, "
                                     f"{time.strftime('%Y-%m-%d')}")
        summary["written"] = str(path)
    return summary


def breakdown_case(problem: Problem, *, warmup: int, iters: int, flush_mib: int) -> dict:
    """Median ms of each launch of the fused path's plan with the tiles it would choose, timed
    alone (L2 flushed before each): where a case's time goes. ``gate_up`` includes the gather
    pass that ``tma_gathered`` launches first (also shown alone as ``gather``); a one-kernel
    entry that cannot run here is timed as the two-kernel fallback its plan names."""
    from .kernels import plan as P
    from .kernels.fused import fused_call, fused_forward, run_plan
    from .kernels.tiles import choose_fused_tiles
    from .kernels.workspace import FusedWorkspace
    from .packed_weights import pack_expert_weights

    cfg, table, x = problem.config, problem.table, problem.x
    packed = pack_expert_weights(problem.weights)
    tiles = choose_fused_tiles(cfg, table.num_routes, x.device)
    ws = FusedWorkspace(x.device)
    out = torch.empty_like(x)
    plan, call = fused_call(x, table, packed, cfg, out=out, tiles=tiles, workspace=ws)
    run_plan(plan.only(P.SCHEDULE), call)  # the schedule the other launches read
    parts = {"schedule": (P.SCHEDULE,), "gate_up+down": (P.EXPERT_MLP,),
             "gather": (P.GATHER_ROWS,), "gate_up": (P.GATHER_ROWS, P.GATE_UP, P.GATE_UP_TMA),
             "down": (P.DOWN, P.DOWN_TMA), "sum": (P.TOPK_SUM,)}
    stages = {name: (lambda part=plan.only(*kernels): run_plan(part, call))
              for name, kernels in parts.items() if set(kernels) & set(plan.kernels)}
    stages["whole"] = lambda: fused_forward(x, table, packed, cfg, out=out, tiles=tiles,
                                            workspace=ws)
    timing = dict(warmup=warmup, iters=iters, flush_mib=flush_mib, device=x.device)
    return {"tiles": asdict(tiles), "plan": list(plan.kernels), "reasons": list(plan.reasons),
            "ms": {name: _time_one(fn, **timing) for name, fn in stages.items()}}


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, multiprocessors=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    return env


def format_table(results: list[dict]) -> str:
    rows = []
    for r in results:
        fl = r["floors"]
        for i, (name, st) in enumerate(r["timings"].items()):
            err = r["parity"].get(name, {}).get("rel_l2")
            rows.append([r["label"] if i == 0 else "",
                         (f"{fl['routed_banks']}/{fl['banks']}, {fl['busiest_over_mean']:.1f}x"
                          if i == 0 and "busiest_over_mean" in fl else ""),
                         f"{fl['memory_floor_ms']:.3f}/{fl['compute_floor_ms']:.3f}" if i == 0 else "",
                         name, f"{st['median_ms']:.3f}", f"{st['p90_ms']:.3f}",
                         f"{st['x_floor']:.2f}" if st.get("x_floor") else "-",
                         f"{err:.2e}" if err is not None else "-"])
    return text_table(["case", "routed banks, busiest/mean", "floor ms (mem/comp)", "path", "median ms",
                       "p90 ms", "x floor", "rel L2"], rows, numeric_columns=(4, 5, 6, 7))


# The harness on the CPU: the Triton paths under the interpreter, at widths it finishes in seconds.
CPU_SMOKE = ("TRITON_INTERPRET=1 python -m magi_moe.benchmark --device cpu --heads 1 --tokens 64 "
             "--experts 8 --top-k 2 --head-dim 64 --inter 128 --warmup 0 --iters 2 --flush-mib 256")
TORCH_ONLY_PATHS = ("routing", "torch-bf16")


def cannot_run_here(device: str | None, paths: tuple[str, ...]) -> str | None:
    """Why the benchmark cannot run as asked on this machine, or None: said before any problem
    is drawn (without it a CPU machine drew production-size problems for most of a minute and
    then failed inside Triton's driver lookup)."""
    from .backends import BACKENDS, interpreter_enabled

    try:
        kind = "cuda" if device is None else torch.device(device).type
    except RuntimeError:
        return f"--device must be cuda, cuda:N or cpu, got {device!r}"
    if kind not in ("cuda", "cpu"):
        return f"--device must be cuda, cuda:N or cpu, got {device!r}"
    if kind == "cuda":
        why = BACKENDS["cuda"].unavailable_reason()
        if why is None:
            return None
        asked = "" if device is None else f"--device {device}: "
        return (f"{asked}{why}. The benchmark times GPU kernels: run it on a CUDA machine, or "
                f"smoke-test the harness on the CPU under the Triton interpreter:\n  {CPU_SMOKE}")
    triton_paths = [p for p in paths if p not in TORCH_ONLY_PATHS]
    if triton_paths and not interpreter_enabled():
        return (f"--device {device} runs the Triton paths ({','.join(triton_paths)}) only under the "
                f"interpreter: set TRITON_INTERPRET=1 before the command, e.g.\n  {CPU_SMOKE}\n"
                f"or time only --paths {','.join(TORCH_ONLY_PATHS)}")
    return None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m magi_moe.benchmark", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096],
                    help="tokens per case; several give several cases (default 4096)")
    ap.add_argument("--heads", type=int, nargs="+", default=[3],
                    help="MoE heads per case; crossed with --tokens (default 3, one EP4-local rank)")
    ap.add_argument("--anchors", action="store_true",
                    help="the four cases of docs/ANCHORS.md instead of --heads x --tokens")
    ap.add_argument("--experts", type=int, default=256, help="experts per head (default 256)")
    ap.add_argument("--top-k", type=int, default=6, help="experts chosen per token and head (default 6)")
    ap.add_argument("--head-dim", type=int, default=256, help="head width Dh (default 256)")
    ap.add_argument("--inter", type=int, default=1280, help="expert intermediate width I (default 1280)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed calls per path first (default 10)")
    ap.add_argument("--iters", type=int, default=100, help="timed calls per path and round (default 100)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds per case; the best round's median is reported (default 1)")
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                    help=f"comma-separated, among {','.join(ALL_PATHS)} (default {','.join(DEFAULT_PATHS)})")
    ap.add_argument("--flush-mib", type=int, default=512,
                    help="MiB zeroed before every timed call to flush the L2 (>= 256; default 512)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the drawn problems (default 0)")
    ap.add_argument("--device", default=None,
                    help="cuda (the default; refused at once without a GPU) or cpu, a smoke test of "
                         "the harness with host timers that needs TRITON_INTERPRET=1 for the Triton paths")
    ap.add_argument("--sweep", action="store_true", help="sweep the fused kernels' tiles first")
    ap.add_argument("--write-tiles", action="store_true", help="with --sweep: update tiles/fused.json")
    ap.add_argument("--sweep-only", action="store_true", help="with --sweep: no benchmark after it")
    ap.add_argument("--merge-tiles", action="store_true",
                    help="with --write-tiles: replace only the tabled classes the swept cases fall in")
    ap.add_argument("--breakdown", action="store_true",
                    help="time each launch of the fused path alone, per case")
    ap.add_argument("--json", metavar="PATH", help="write everything measured here as JSON")
    ap.add_argument("--draw", default="anchors",
                    help=f"routing draws, comma-separated, among {','.join(DRAWS)} (default anchors, "
                         "docs/ANCHORS.md's; 'concentrated' routes to about a third of the experts)")
    args = ap.parse_args(argv)
    args.draws = tuple(d for d in args.draw.split(",") if d)
    if not args.draws or any(d not in DRAWS for d in args.draws):
        ap.error(f"--draw must be among {','.join(DRAWS)}, got {args.draw!r}")
    args.paths = tuple(p for p in args.paths.split(",") if p)
    bad = [p for p in args.paths if p not in ALL_PATHS]
    if bad:
        ap.error(f"--paths must be among {','.join(ALL_PATHS)}, got {','.join(bad)}")
    if args.flush_mib < 256:
        ap.error("--flush-mib must be at least 256 (the flush must exceed the L2 several times)")
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        ap.error("--iters and --rounds must be >= 1, --warmup >= 0")
    why = cannot_run_here(args.device, args.paths)
    if why:
        ap.error(why)
    args.device = args.device or "cuda"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    pairs = ANCHOR_CASES if args.anchors else [(h, s) for h in args.heads for s in args.tokens]
    cases = [BenchCase(h, s, args.experts, args.top_k, args.head_dim, args.inter, args.seed, draw)
             for draw in args.draws for h, s in pairs]
    report: dict = {"environment": environment(device), "args": {k: v for k, v in vars(args).items()},
                    "ceilings": {"copy_gbps": COPY_GBPS, "matmul_tflops": MATMUL_TFLOPS}}
    if args.sweep:
        report["sweep"] = run_sweep(cases, device=device, warmup=3, iters=max(5, args.iters // 5),
                                    flush_mib=args.flush_mib, write=args.write_tiles,
                                    merge=args.merge_tiles)
        print(json.dumps({k: report["sweep"][k] for k in ("classes", "routing")}, indent=1), flush=True)
    if args.breakdown:
        report["breakdown"] = {}
        for case in cases:
            problem = draw_problem(case, device)
            bd = breakdown_case(problem, warmup=args.warmup, iters=args.iters,
                                flush_mib=args.flush_mib)
            report["breakdown"][case.label] = bd
            print(f"{case.label:<15} fused launches (ms): "
                  + "  ".join(f"{k} {v:.3f}" for k, v in bd["ms"].items()), flush=True)
            del problem
    results = []
    for case in ([] if args.sweep and args.sweep_only else cases):
        results.append(run_case(case, args.paths, device=device, warmup=args.warmup,
                                iters=args.iters, rounds=args.rounds, flush_mib=args.flush_mib))
        print(format_table(results[-1:]), flush=True)
    report["results"] = results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if results:
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
