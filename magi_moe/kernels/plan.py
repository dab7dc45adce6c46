"""The fused path's launch plan: which kernels run, with which tiles and grids, and why.

:func:`plan_fused` decides on the host, before anything launches, from the config, the token and
route counts, the tiles asked for, the device (:class:`~.device.DeviceFacts`) and the weights'
layout; :func:`magi_moe.kernels.fused.run_plan` launches the steps in order, each by the
launcher it carries. Where the tiles ask for a kernel that cannot run, the plan takes the
fallback and says why in ``reasons``:

* ``mlp_tma`` (one kernel for gate/up and down, :mod:`.expert_mlp`) needs TMA (Hopper or
  later), a head width that is a power of two in 16..256 (a ``[Dh, BLOCK_N]`` tile is one
  descriptor box), weights a descriptor can view, and, on a GPU, a compiled kernel that fits
  its shared memory (measured on the compiled kernel by the caller's ``shared_memory_of``).
  Otherwise gate/up + down run (:mod:`.gate_up_down`), on :func:`~.tiles.two_kernel_tiles`.
* ``kloop`` tiles run gate/up + down as asked; they need nothing a GPU may lack.

A plan for a real device: ``plan_fused(cfg, S, R, tiles, device_facts(x.device), weights)``;
for a GPU this machine lacks: ``DeviceFacts(tma=True, shared_memory=232448,
multiprocessors=132)``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..config import MoEConfig
from ..weights import ExpertWeights
from .descriptors import banked_problem
from .device import DeviceFacts, persistent_grid
from .expert_mlp import EXPERT_MLP
from .gate_up_down import DOWN, GATE_UP
from .launch_steps import Launcher, LaunchStep
from .schedule import SCHEDULE, cdiv, max_blocks, schedule_programs
from .tiles import FusedTiles, two_kernel_tiles
from .topk_sum import TOPK_SUM

NO_TMA = "no TMA (tensor descriptors) before Hopper"


@dataclass(frozen=True)
class LaunchPlan:
    """The launches of one fused call, in order. ``asked``: the tiles the caller gave;
    ``max_blocks``: the block schedule's entries (0 without routes); ``reasons``: one line per
    fallback taken (empty when the tiles run as asked); ``clear_slots``: ``slot_route`` is set
    to -1 first, because the table leaves some (token, head, k) slots without a route;
    ``activation_rows``: rows of the two-kernel path's activation buffer (0: no such path)."""

    steps: tuple[LaunchStep, ...]
    asked: FusedTiles
    facts: DeviceFacts
    max_blocks: int
    reasons: tuple[str, ...] = ()
    clear_slots: bool = False
    activation_rows: int = 0

    @property
    def kernels(self) -> tuple[str, ...]:
        """The Triton kernels' names, in launch order."""
        return tuple(s.kernel for s in self.steps)

    def step(self, kernel: Launcher | str) -> LaunchStep:
        """The step of ``kernel`` (a launcher or its kernel's name)."""
        for s in self.steps:
            if s.kernel == str(kernel):
                return s
        raise KeyError(f"the plan launches {self.kernels}, not {str(kernel)!r}")

    def only(self, *kernels: Launcher | str) -> "LaunchPlan":
        """The same plan restricted to ``kernels`` (launchers or names; a tuner times one launch
        at a time); its buffers stay the whole plan's."""
        names = {str(k) for k in kernels}
        return replace(self, steps=tuple(s for s in self.steps if s.kernel in names))

    def __str__(self) -> str:
        lines = [f"{s.kernel} x {s.grid}" for s in self.steps]
        return "; ".join(lines) + "".join(f"\n  because {r}" for r in self.reasons)


def whole_head_problem(config: MoEConfig) -> str | None:
    """Why the one-kernel path cannot load ``[Dh, BLOCK_N]`` weight tiles in one descriptor box
    (a power of two, at most 256 per side), or None."""
    dh = config.head_dim
    if dh & (dh - 1) == 0 and 16 <= dh <= 256:
        return None
    return f"head_dim {dh} is not a power of two in 16..256"


def _weight_problems(weights: ExpertWeights, names: tuple[str, ...]) -> list[str]:
    found = ((name, banked_problem(getattr(weights, name))) for name in names)
    return [f"{name}: {why}" for name, why in found if why is not None]


def _one_kernel_problems(config: MoEConfig, facts: DeviceFacts, weights: ExpertWeights) -> list[str]:
    if not facts.tma:
        return [NO_TMA]
    head = whole_head_problem(config)
    return ([head] if head else []) + _weight_problems(weights, ("w_gate", "w_up", "w_down"))


def plan_fused(config: MoEConfig, num_tokens: int, num_routes: int, tiles: FusedTiles,
               facts: DeviceFacts, weights: ExpertWeights, *, schedule_built: bool = False,
               rows_only: bool = False,
               shared_memory_of: Callable[[LaunchStep], int] | None = None) -> LaunchPlan:
    """The launches of one fused call on a device with ``facts``.

    ``schedule_built``: the block schedule exists already (the fused router built it), so no
    schedule launch. ``rows_only``: the expert rows without the top-k sum (the huge-offset
    fuzzer's entry; the caller then owns ``slot_route``'s unrouted slots). ``shared_memory_of(step)``: bytes of shared memory the step's compiled
    kernel needs; asked only for the one-kernel step, only where ``facts.shared_memory`` is
    known (on a GPU), and only once everything else allows the step."""
    # Every size first, then the choice: the grids of both expert paths are known up front
    # (``two``: the two-kernel path's tiles, the asked ones unless they ask for "mlp_tma").
    two = two_kernel_tiles(tiles, config)
    nb = max_blocks(num_routes, config.num_banks, tiles.block_m) if num_routes else 0
    sum_grid = cdiv(num_tokens * config.num_heads, tiles.sum_block_t)
    schedule_grid = schedule_programs(num_routes, config.num_banks, tiles.block_m, facts)
    one_grid = persistent_grid(nb, tiles.gu_programs_per_sm, facts)
    gate_up_grid = persistent_grid(nb * (config.intermediate_size // two.gu_block_n),
                                   two.gu_programs_per_sm, facts)
    down_grid = persistent_grid(nb * (config.head_dim // two.down_block_n),
                                two.down_programs_per_sm, facts)
    reasons: list[str] = []
    steps: list[LaunchStep] = []
    act_rows = 0
    if num_routes:
        if not schedule_built:
            steps.append(LaunchStep(SCHEDULE, schedule_grid, tiles))
        expert = tiles
        if tiles.gu_variant == "mlp_tma":
            one = LaunchStep(EXPERT_MLP, one_grid, tiles)
            why = _one_kernel_problems(config, facts, weights)
            if not why and facts.shared_memory is not None and shared_memory_of is not None:
                need = shared_memory_of(one)
                if need > facts.shared_memory:
                    why.append(f"{EXPERT_MLP} compiled for these tiles needs {need / 1024:.1f} KiB "
                               f"of shared memory > the GPU's {facts.shared_memory / 1024:.1f} KiB")
            if why:
                reasons.append(f"gu_variant 'mlp_tma' -> {GATE_UP} + {DOWN}: " + "; ".join(why))
                expert = two
            else:
                steps.append(one)
                expert = None
        if expert is not None:
            steps += [LaunchStep(GATE_UP, gate_up_grid, expert),
                      LaunchStep(DOWN, down_grid, expert)]
            act_rows = nb * expert.block_m
    sums = not rows_only and num_tokens > 0
    if sums:
        steps.append(LaunchStep(TOPK_SUM, sum_grid, tiles))
    clear = sums and num_routes < num_tokens * config.num_heads * config.top_k
    return LaunchPlan(tuple(steps), tiles, facts, nb, tuple(reasons), clear, act_rows)
