"""The fused kernels' tile sweep (``--sweep``), which writes the winners into the tile tables
(``magi_moe/kernels/tiles/fused.json``, format in ``tiles/README.md``), and the per-launch
breakdown (``--breakdown``). Both time the fused path's launch plan one step at a time
(:mod:`magi_moe.kernels.plan`): a candidate whose plan falls back to another kernel on this
device is recorded as failed, never timed as something else."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, replace

import torch

from ..problems import Problem, same_bits
from .cases import BenchCase, draw_problem
from .timing import time_one


# Gate/up candidates as FusedTiles fields, each with the programs per SM to try: "kloop" loops
# over Dh per column tile, "tma_gathered" loads tiles by tensor descriptor (kernels/fused_tma.py).
# Earlier forms (docs/PERFORMANCE.md) also tried flattened loops, "wide" kernels that loaded a
# block's x rows once (pointer and descriptor forms), BK=16, 64x256 tiles, register caps and
# Triton's warp specialisation (wrong outputs on Triton 3.6): slower or wrong, dropped.
def _gu(variant, bm, bn, bk, warps, stages, ppsm=(1, 2), act="ptr", maxnreg=0):
    tiles = dict(gu_variant=variant, block_m=bm, gu_block_n=bn, gu_block_k=bk, gu_warps=warps,
                 gu_stages=stages, gu_act_store=act, **({"gu_maxnreg": maxnreg} if maxnreg else {}))
    return [{**tiles, "gu_programs_per_sm": p} for p in ppsm]


def _dn(bm, bn, bk, warps, stages, ppsm=(1, 2), variant="ptr"):
    return [dict(block_m=bm, down_block_n=bn, down_block_k=bk, down_warps=warps,
                 down_stages=stages, down_programs_per_sm=p, down_variant=variant) for p in ppsm]


GATE_UP_CANDIDATES = tuple(c for group in (
    # the pointer-load winner: each block size's first candidate is the reference
    # the others are checked against
    _gu("kloop", 64, 128, 32, 4, 5, (2,)),
    _gu("kloop", 128, 128, 32, 8, 4, (1,)),
    # both operands by descriptor, x rows gathered first (the gathered-x winner first)
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
    # one warpgroup, two programs per SM (about 104 KiB of shared memory each): small banks
    _gu("mlp_tma", 64, 16, 256, 4, 3, (2,)), _gu("mlp_tma", 64, 64, 256, 4, 2, (1,)),
    # two warpgroups, one per 64 rows: the activation stays in the warpgroup that made it
    _gu("mlp_tma", 128, 32, 256, 8, 3, (1,)), _gu("mlp_tma", 128, 32, 256, 8, 2, (1,)),
    _gu("mlp_tma", 128, 16, 256, 8, 4, (1,)),
) for c in group)
# Timed on the H200 and dropped (docs/PERFORMANCE.md, "The one-kernel loop"): 64 rows on two warpgroups (each MMA
# split along N), 2.9-3.3x slower than on one, with or without a 128-register cap and two
# programs per SM; x as the gate/up MMAs' register operand, and gate and up as one dot of twice
# the columns, 10-25% slower than the forms above.
DOWN_CANDIDATES = tuple(c for group in (
    _dn(64, 128, 64, 4, 4, (2,)), _dn(128, 256, 64, 8, 3, (1,)),
    _dn(64, 128, 64, 4, 4, (2,), variant="tma"), _dn(128, 256, 64, 8, 3, (1,), variant="tma"),
) for c in group)
SUM_CANDIDATES = ((8, 4), (16, 4), (32, 4), (32, 8))
ROUTING_CANDIDATES = (  # (block_s, block_d, warps, place_warps)
    (16, 64, 4, 4), (32, 64, 4, 4), (32, 64, 8, 8), (16, 32, 4, 4), (32, 32, 8, 4), (32, 32, 4, 4),
    # more tokens per program (the head's gate, 256 KiB in fp32, is read once per token block)
    # and shorter gate slices: slower on the H200 (docs/PERFORMANCE.md), kept for other GPUs;
    # 16-warp forms with 64-128 tokens (5-9x slower, or over shared memory) were dropped
    (64, 32, 8, 4), (32, 16, 8, 4),
)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, no NaN: a candidate must give the reference candidate's result exactly, so
    that the tiles a problem gets (its route counts, head count, device) never change a
    token's output. Expert parallelism's bitwise promise rests on this (docs/DESIGN.md)."""
    return not bool(torch.isnan(got).any()) and same_bits(got, want)


SWEPT_KERNELS = ("gate_up", "down", "mlp", "sum", "routing")


def sweep_case(problem: Problem, *, warmup: int, iters: int, flush_mib: int,
               routing: bool = True, kernels: tuple[str, ...] = SWEPT_KERNELS) -> dict:
    """Median ms of every candidate of each fused kernel in ``kernels`` on this problem. Each
    gate/up candidate's activations are checked against the first candidate of its block
    schedule, and every candidate's expert rows against the first rows made (any schedule:
    the bits must not depend on the tiles); all NaN-poisoned first. A candidate that fails to
    compile, launch or agree, or whose launch plan falls back to another kernel here (timing a
    launch that did not happen would look fast), is recorded with ``ms: None``."""
    from ..kernels import fused_routing as FR
    from ..kernels import plan as P
    from ..kernels.device import device_facts
    from ..kernels.fused import FusedCall, compiled_shared_memory, launch_gather_rows, run_plan
    from ..kernels.descriptors import step_descriptors
    from ..kernels.schedule import launch_block_schedule
    from ..kernels.tiles import FusedTiles, RoutingTiles
    from ..kernels.workspace import FusedWorkspace
    from ..packed_weights import pack_expert_weights

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
            ms = time_one(launch, **timing) if ok else None
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
                            shared_memory_of=compiled_shared_memory(packed, cfg)
                            if device.type == "cuda" else None)
        if plan.reasons:
            raise RuntimeError("cannot run here: " + "; ".join(plan.reasons))
        part = plan.only(*kernels)
        launched = replace(call, descriptors=step_descriptors(part.steps, packed, cfg.head_dim,
                                                              call.act, call.gathered))
        return lambda: run_plan(part, launched)

    def chosen(candidates, kernel):
        return [c for c in candidates if kernel in kernels and c["block_m"] == bm]

    def time_rows(kernel, cand, tiles, launched):
        """Time one candidate that writes the expert rows, checked bit for bit (NaN-poisoned
        first) against the first rows any candidate made."""
        launch = None

        def run():
            nonlocal launch
            launch = launch or steps(call, tiles, *launched)
            launch()

        def check():
            nonlocal want_rows
            rows.fill_(float("nan"))
            run()
            if want_rows is None:
                want_rows = rows.clone()
            return _same_bits(rows, want_rows)
        attempt(kernel, cand, run, check)

    want_rows = None
    for bm in sorted({c["block_m"] for c in GATE_UP_CANDIDATES + DOWN_CANDIDATES
                      + MLP_CANDIDATES}):
        if not any(chosen(c, k) for c, k in ((GATE_UP_CANDIDATES, "gate_up"),
                                            (DOWN_CANDIDATES, "down"), (MLP_CANDIDATES, "mlp"))):
            continue
        sched = launch_block_schedule(table.offsets, R, cfg.num_banks, bm, ws)
        results["schedule"][bm] = time_one(
            lambda: launch_block_schedule(table.offsets, R, cfg.num_banks, bm, ws), **timing)
        live = int(sched.block_count[0]) * bm
        xg = ws.get("x_gathered", (sched.max_blocks * bm, cfg.head_dim), problem.x.dtype)
        results["gather"][bm] = time_one(  # part of every "tma_gathered" time: shown apart
            lambda: launch_gather_rows(problem.x, table, sched, xg, cfg), **timing)
        act = torch.empty(sched.max_blocks * bm, cfg.intermediate_size, dtype=cfg.dtype,
                          device=device)
        call = FusedCall(problem.x, table, packed, cfg, ws, sched, rows, slot_route, out, act, xg)
        want_act = None
        for cand in chosen(GATE_UP_CANDIDATES, "gate_up"):
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
                return _same_bits(act[:live], want_act) and _same_bits(got, want_act)
            attempt("gate_up", cand, gate_up, check)
        # down (reading the activations above) and the one-kernel candidates write the same
        # rows: every one must give the first rows made, whatever its block size
        for kernel, candidates, launched in (("down", DOWN_CANDIDATES, (P.DOWN, P.DOWN_TMA)),
                                             ("mlp", MLP_CANDIDATES, (P.EXPERT_MLP,))):
            for cand in chosen(candidates, kernel):
                time_rows(kernel, cand, FusedTiles(**cand).fitted(cfg), launched)
    # the sum reads the slot map an expert kernel wrote: no expert kernel, no sum
    experts = {"gate_up", "down", "mlp"} & set(kernels)
    for bt, warps in (SUM_CANDIDATES if "sum" in kernels and experts else ()):
        tiles = FusedTiles(sum_block_t=bt, sum_warps=warps)
        attempt("sum", {"sum_block_t": bt, "sum_warps": warps},
                steps(call, tiles, P.TOPK_SUM), lambda: True)
    want_ids = None
    for bs, bd, warps, pwarps in (ROUTING_CANDIDATES if routing and "routing" in kernels else ()):
        rt = RoutingTiles(block_s=bs, block_d=bd, warps=warps, place_warps=pwarps)

        def route_once():
            return FR.fused_route(problem.x, problem.gate, problem.bias, cfg, block_m=64,
                                  workspace=ws, tiles=rt)

        # Routing tiles may change bits (block_d orders the logits' sums): a GPU has one routing
        # entry, whatever the problem, so no token's result depends on the problem's shape. The
        # same experts for all but near-ties flipped by that order, probabilities finite.
        def check():
            nonlocal want_ids
            fr = route_once()
            got = fr.expert_ids.clone()
            if want_ids is None:
                want_ids = got
            return (same_choices(got, want_ids) >= ROUTING_AGREEMENT
                    and bool(torch.isfinite(fr.probs).all()))
        attempt("routing", {"block_s": bs, "block_d": bd, "warps": warps, "place_warps": pwarps},
                route_once, check)
    return results


# Share of (token, head) rows that must choose the same experts as the reference candidate.
ROUTING_AGREEMENT = 0.999


def same_choices(ids: torch.Tensor, want: torch.Tensor) -> float:
    """Share of (token, head) rows of ``[S, H, K]`` expert ids choosing the same set as
    ``want``. Compared per row, not by CSR position: one near-tie flip moves the CSR position
    of every later route of both banks involved, which failed every ``block_d`` but the
    reference's at S=16384 on the H200."""
    if ids.numel() == 0:
        return 1.0
    same = (ids.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1)
    return float(same.double().mean())


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
    from ..kernels.tiles import FusedTiles

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
        if best is None or total < best[0]:
            best = (total, m, ())
    if best is None:
        raise ValueError("no expert-kernel candidate ran in every case: nothing to choose")
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
    from ..kernels.tiles import load_tile_table

    tabled = load_tile_table(device_name, path)
    if not tabled:
        return None
    classes = list(tabled)
    for centre, tiles in swept:
        i = next(i for i, (edge, _) in enumerate(classes) if centre <= edge)
        classes[i] = (classes[i][0], tiles)
    return classes


def run_sweep(cases: list[BenchCase], *, device: torch.device, warmup: int, iters: int,
              flush_mib: int, write: bool, merge: bool = False,
              kernels: tuple[str, ...] = SWEPT_KERNELS) -> dict:
    """Sweep every case, group the cases by routes per bank, write the winners per group
    (``merge``: into the tabled classes they fall in, keeping the rest of the table)."""
    from ..kernels.tiles import load_device_entry, load_tile_table, write_tile_table

    per_case = {}
    for case in cases:
        problem = draw_problem(case, device)
        t0 = time.time()
        per_case[case.label] = {"routes_per_bank": problem.table.num_routes / problem.config.num_banks,
                                "sweep": sweep_case(problem, warmup=warmup, iters=iters,
                                                    flush_mib=flush_mib, routing=not merge,
                                                    kernels=kernels)}
        print(f"swept {case.label} in {time.time() - t0:.1f} s", flush=True)
        del problem
    # Classes: cases with the same routes per bank share tiles; edges at geometric midpoints.
    groups: dict[float, list[dict]] = {}
    for entry in per_case.values():
        groups.setdefault(round(entry["routes_per_bank"], 3), []).append(entry["sweep"])
    centres = sorted(groups)
    classes = []
    experts_swept = bool({"gate_up", "down", "mlp"} & set(kernels))
    for i, c in enumerate(centres if experts_swept else ()):
        edge = math.sqrt(c * centres[i + 1]) if i + 1 < len(centres) else None
        classes.append((edge, best_tiles(groups[c])))
    if not experts_swept and device.type == "cuda":  # routing only: the tabled classes stay
        tabled = load_tile_table(torch.cuda.get_device_name(device)) or []
        classes = [(None if math.isinf(edge) else edge, tiles) for edge, tiles in tabled]
    routing = (best_routing([e["sweep"] for e in per_case.values()])
               if not merge and "routing" in kernels else None)
    if merge and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tabled = merged_classes([(c, best_tiles(groups[c])) for c in centres], name)
        if tabled is not None:
            classes = [(None if math.isinf(edge) else edge, tiles) for edge, tiles in tabled]
            routing = (load_device_entry(name) or {}).get("routing", routing)
    if routing is None and device.type == "cuda":  # routing not swept: keep the tabled tiles
        routing = (load_device_entry(torch.cuda.get_device_name(device)) or {}).get("routing")
    summary = {"per_case": per_case, "routing": routing,
               "classes": [{"max_routes_per_bank": e, "tiles": asdict(t)} for e, t in classes]}
    if write and device.type == "cuda" and classes:
        name = torch.cuda.get_device_name(device)
        match = "H200" if "H200" in name else name
        path = write_tile_table(match, classes, routing=routing,
                                note=f"swept on {name} by magi_moe.bench --sweep "
                                     f"(kernels {','.join(k for k in kernels if experts_swept or k != 'sum')}), "
                                     f"{time.strftime('%Y-%m-%d')}"
                                     + ("" if "routing" in kernels and not merge
                                        else "; routing tiles kept from the previous entry")
                                     + ("" if experts_swept
                                        else "; expert tiles kept from the previous entry"))
        summary["written"] = str(path)
    return summary


def breakdown_case(problem: Problem, *, warmup: int, iters: int, flush_mib: int) -> dict:
    """Median ms of each launch of the fused path's plan with the tiles it would choose, timed
    alone (L2 flushed before each): where a case's time goes. ``gate_up`` includes the gather
    pass that ``tma_gathered`` launches first (also shown alone as ``gather``); a one-kernel
    entry that cannot run here is timed as the two-kernel fallback its plan names. ``route`` is
    the fused layer's router alone and ``layer`` the whole fused layer: ``layer - whole`` is what
    the layer costs over its kernel."""
    from ..kernels import plan as P
    from ..kernels.fused import fused_forward, run_plan
    from .kernel_level import KernelLevel

    cfg, table, x = problem.config, problem.table, problem.x
    level = KernelLevel.of(problem)
    packed, tiles = level.packed, level.tiles()
    plan, call = level.call(tiles)
    out, ws = call.out, call.workspace
    run_plan(plan.only(P.SCHEDULE), call)  # the schedule the other launches read
    parts = {"schedule": (P.SCHEDULE,), "gate_up+down": (P.EXPERT_MLP,),
             "gather": (P.GATHER_ROWS,), "gate_up": (P.GATHER_ROWS, P.GATE_UP, P.GATE_UP_TMA),
             "down": (P.DOWN, P.DOWN_TMA), "sum": (P.TOPK_SUM,)}
    stages = {name: (lambda part=plan.only(*kernels): run_plan(part, call))
              for name, kernels in parts.items() if set(kernels) & set(plan.kernels)}
    stages["whole"] = lambda: fused_forward(x, table, packed, cfg, out=out, tiles=tiles,
                                            workspace=ws)
    # The layer's own work beside it: the fused router (its four launches, block schedule
    # included) and the whole layer, on a workspace of their own so that the stages above keep
    # reading their schedule.
    from ..kernels.fused_layer import fused_layer_forward
    from ..kernels.router import fused_route
    from ..kernels.workspace import FusedWorkspace
    layer_ws, layer_out = FusedWorkspace(x.device), torch.empty_like(x)
    gate, bias = problem.gate, problem.bias
    stages["route"] = lambda: fused_route(x, gate, bias, cfg, block_m=tiles.block_m,
                                          workspace=layer_ws)
    stages["layer"] = lambda: fused_layer_forward(x, gate, bias, packed, cfg, out=layer_out,
                                                  workspace=layer_ws)
    timing = dict(warmup=warmup, iters=iters, flush_mib=flush_mib, device=x.device)
    return {"tiles": asdict(tiles), "plan": list(plan.kernels), "reasons": list(plan.reasons),
            "ms": {name: time_one(fn, **timing) for name, fn in stages.items()}}
