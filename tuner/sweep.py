"""One case's tile candidates timed (:class:`CaseSweep`), each launch through the fused path's
own launch plan (:mod:`magi_moe.kernels.plan`) one step at a time: a candidate whose plan falls
back to another kernel on this device is recorded as failed, never timed as something else.

Every candidate's output is checked before it is timed, NaN-poisoned first: each gate/up
candidate's activations against the first candidate of its block size, and every candidate's
expert rows against the first rows made (any block size: the bits must not depend on the
tiles). Routing candidates may change bits (``block_d`` orders the logits' sums), so they are
compared by the experts each row chose (:func:`~.choose.same_choices`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from magi_moe.bench.timing import time_one
from magi_moe.kernels.descriptors import step_descriptors
from magi_moe.kernels.device import device_facts
from magi_moe.kernels.expert_mlp import EXPERT_MLP, compiled_shared_memory
from magi_moe.kernels.fused import run_plan
from magi_moe.kernels.gate_up_down import DOWN, GATE_UP
from magi_moe.kernels.launch_steps import FusedCall, Launcher
from magi_moe.kernels.plan import plan_fused
from magi_moe.kernels.router import fused_route
from magi_moe.kernels.schedule import launch_block_schedule
from magi_moe.kernels.tiles import FusedTiles, RoutingTiles
from magi_moe.kernels.topk_sum import TOPK_SUM
from magi_moe.kernels.workspace import FusedWorkspace
from magi_moe.packed_weights import pack_expert_weights
from magi_moe.problems import Problem, same_bits

from .candidates import (DOWN_CANDIDATES, GATE_UP_CANDIDATES, MLP_CANDIDATES, ROUTING_CANDIDATES,
                         SUM_CANDIDATES, SWEPT_KERNELS)
from .choose import ROUTING_AGREEMENT, same_choices

# what each swept kernel name times, and its candidates
EXPERT_KERNELS = {"gate_up": (GATE_UP_CANDIDATES, (GATE_UP,)),
                  "down": (DOWN_CANDIDATES, (DOWN,)),
                  "mlp": (MLP_CANDIDATES, (EXPERT_MLP,))}


def exact(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, no NaN: a candidate must give the reference candidate's result exactly, so
    that the tiles a problem gets (its route counts, head count, device) never change a
    token's output. Expert parallelism's bitwise promise rests on this (docs/DESIGN.md)."""
    return not bool(torch.isnan(got).any()) and same_bits(got, want)


class CaseSweep:
    """The candidates of ``kernels`` timed on one problem: :meth:`run` returns, per kernel, a
    list of ``{"tiles", "ms"}`` (``ms`` None, with an ``error``, for a candidate that failed
    to compile, launch or agree, or whose plan falls back here), and the block schedule's own
    time per block size."""

    def __init__(self, problem: Problem, *, warmup: int, iters: int, flush_mib: int,
                 kernels: tuple[str, ...] = SWEPT_KERNELS):
        self.problem, self.kernels = problem, kernels
        self.cfg, device = problem.config, problem.x.device
        self.packed = pack_expert_weights(problem.weights)
        self.workspace = FusedWorkspace(device)
        R, S = problem.table.num_routes, problem.num_tokens
        self.rows = torch.empty(R, self.cfg.head_dim, dtype=torch.float32, device=device)
        self.slot_route = torch.empty(S * self.cfg.num_heads * self.cfg.top_k, dtype=torch.int32,
                                      device=device)
        self.out = torch.empty_like(problem.x)
        self.facts = device_facts(device)
        self.shared_memory_of = (compiled_shared_memory(self.packed, self.cfg)
                                 if device.type == "cuda" else None)
        self.timing = dict(warmup=warmup, iters=iters, flush_mib=flush_mib, device=device)
        self.results: dict = {"gate_up": [], "down": [], "mlp": [], "sum": [], "routing": [],
                              "schedule": {}}
        self.want_rows: torch.Tensor | None = None
        self.call: FusedCall | None = None

    def run(self, routing: bool = True) -> dict:
        for bm in sorted({c["block_m"] for name in EXPERT_KERNELS for c in self._candidates(name)}):
            self._block_size(bm)
        if "sum" in self.kernels and self.call is not None:  # the sum reads an expert kernel's
            self._sums()                                        # slot map: none, no sum
        if routing and "routing" in self.kernels:
            self._routing()
        return self.results

    def _candidates(self, kernel: str, block_m: int | None = None) -> list[dict]:
        if kernel not in self.kernels:
            return []
        return [c for c in EXPERT_KERNELS[kernel][0] if block_m in (None, c["block_m"])]

    def _attempt(self, kernel: str, tiles: dict, launch: Callable[[], None],
                 check: Callable[[], bool]) -> None:
        """Launch, check, then time one candidate; an exception or a wrong output is recorded."""
        try:
            launch()
            ok = check()
            ms = time_one(launch, **self.timing) if ok else None
            error = None if ok else "output disagrees"
        except Exception as exc:  # out of resources, compile errors: record and go on
            ms, error = None, f"{type(exc).__name__}: {exc}"[:300]
        self.results[kernel].append({"tiles": tiles, "ms": ms, **({"error": error} if error else {})})
        if error:
            print(f"  {kernel} {tiles}: {error[:160]}", flush=True)

    def _launch_of(self, tiles: FusedTiles, *launchers: Launcher) -> Callable[[], None]:
        """The launches of ``launchers`` that ``tiles`` plan here; an error where the plan falls
        back, so a candidate is timed only as itself."""
        p = self.problem
        plan = plan_fused(self.cfg, p.num_tokens, p.table.num_routes, tiles, self.facts,
                          self.packed, schedule_built=True, shared_memory_of=self.shared_memory_of)
        if plan.reasons:
            raise RuntimeError("cannot run here: " + "; ".join(plan.reasons))
        part = plan.only(*launchers)
        call = replace(self.call, descriptors=step_descriptors(part.steps, self.packed,
                                                               self.cfg.head_dim))
        return lambda: run_plan(part, call)

    def _lazy(self, tiles: FusedTiles, *launchers: Launcher) -> Callable[[], None]:
        """:meth:`_launch_of`, planned at the first call (inside :meth:`_attempt`, so that a
        plan's refusal is recorded as the candidate's failure)."""
        launch = None

        def run() -> None:
            nonlocal launch
            launch = launch or self._launch_of(tiles, *launchers)
            launch()
        return run

    def _block_size(self, bm: int) -> None:
        """Every expert candidate of block size ``bm``, on a schedule built for it."""
        if not any(self._candidates(k, bm) for k in EXPERT_KERNELS):
            return
        p, cfg, ws = self.problem, self.cfg, self.workspace
        R = p.table.num_routes
        schedule = launch_block_schedule(p.table.offsets, R, cfg.num_banks, bm, ws)
        self.results["schedule"][bm] = time_one(
            lambda: launch_block_schedule(p.table.offsets, R, cfg.num_banks, bm, ws), **self.timing)
        act = torch.empty(schedule.max_blocks * bm, cfg.intermediate_size, dtype=cfg.dtype,
                          device=p.x.device)
        self.call = FusedCall(p.x, p.table, self.packed, cfg, ws, schedule, self.rows,
                              self.slot_route, self.out, act)
        self._gate_ups(bm, act[:int(schedule.block_count[0]) * bm])
        # down (reading the activations above) and the one-kernel candidates write the same
        # rows: every one must give the first rows made, whatever its block size
        for kernel in ("down", "mlp"):
            for cand in self._candidates(kernel, bm):
                self._rows_candidate(kernel, cand)

    def _gate_ups(self, bm: int, live: torch.Tensor) -> None:
        """The gate/up candidates of block size ``bm``: each one's live activation rows the
        first one's, before (what the last candidate left) and after its own NaN-poisoned run."""
        want = None
        for cand in self._candidates("gate_up", bm):
            launch = self._lazy(FusedTiles(**cand).fitted(self.cfg), GATE_UP)

            def check() -> bool:
                nonlocal want
                before = live.clone()
                self.call.act.fill_(float("nan"))
                launch()
                if want is None:
                    want = live.clone()
                return exact(live, want) and exact(before, want)
            self._attempt("gate_up", cand, launch, check)

    def _rows_candidate(self, kernel: str, cand: dict) -> None:
        """One candidate that writes the expert rows, checked bit for bit (NaN-poisoned first)
        against the first rows any candidate made."""
        launch = self._lazy(FusedTiles(**cand).fitted(self.cfg), *EXPERT_KERNELS[kernel][1])

        def check() -> bool:
            self.rows.fill_(float("nan"))
            launch()
            if self.want_rows is None:
                self.want_rows = self.rows.clone()
            return exact(self.rows, self.want_rows)
        self._attempt(kernel, cand, launch, check)

    def _sums(self) -> None:
        for block_t, warps in SUM_CANDIDATES:
            tiles = FusedTiles(sum_block_t=block_t, sum_warps=warps)
            self._attempt("sum", {"sum_block_t": block_t, "sum_warps": warps},
                          self._lazy(tiles, TOPK_SUM), lambda: True)

    def _routing(self) -> None:
        """Routing candidates: a GPU has one routing entry, whatever the problem, so no token's
        result depends on the problem's shape; each must choose the same experts as the first
        for all but near-ties flipped by its sum order, with finite probabilities."""
        p, want = self.problem, None
        for block_s, block_d, warps, place_warps in ROUTING_CANDIDATES:
            tiles = RoutingTiles(block_s=block_s, block_d=block_d, warps=warps,
                                 place_warps=place_warps)

            def route(tiles=tiles):
                return fused_route(p.x, p.gate, p.bias, self.cfg, block_m=64,
                                   workspace=self.workspace, tiles=tiles)

            def check() -> bool:
                nonlocal want
                found = route()
                got = found.expert_ids.clone()
                if want is None:
                    want = got
                return (same_choices(got, want) >= ROUTING_AGREEMENT
                        and bool(torch.isfinite(found.probs).all()))
            self._attempt("routing", {"block_s": block_s, "block_d": block_d, "warps": warps,
                                      "place_warps": place_warps}, route, check)


def sweep_case(problem: Problem, *, warmup: int, iters: int, flush_mib: int,
               routing: bool = True, kernels: tuple[str, ...] = SWEPT_KERNELS) -> dict:
    """Median ms of every candidate of each fused kernel in ``kernels`` on ``problem``
    (:class:`CaseSweep`)."""
    return CaseSweep(problem, warmup=warmup, iters=iters, flush_mib=flush_mib,
                     kernels=kernels).run(routing)
