"""A launch of the fused path: :class:`LaunchStep` (which kernel, its grid, its tiles), the
:class:`Launcher` a step carries (the kernel's name and how to launch it, defined beside the
kernel in its family's file) and :class:`FusedCall`, the tensors the launches read and write
(with :class:`BlockSchedule`, the block schedule's buffers, :mod:`.schedule` builds).

The planner (:mod:`.plan`) picks the launchers; :func:`~.fused.run_plan` calls
``step.launcher.launch(step, call)`` for each step, knowing no kernel by name. A kernel family
is one file: its Triton kernels, their launchers and, for descriptor kernels, the descriptors
they read (:mod:`.gate_up_down`, :mod:`.expert_mlp`, :mod:`.topk_sum`, :mod:`.schedule`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..backends import interpreter_enabled
from ..config import MoEConfig
from ..routing import RouteTable
from ..weights import ExpertWeights
from .tiles import FusedTiles
from .workspace import FusedWorkspace


@dataclass(frozen=True)
class BlockSchedule:
    """Device-side block schedule: ``block_bank`` int32 and ``block_start`` int64
    ``[max_blocks]`` (valid below the live count), ``block_count`` int32 ``[1]`` (the live
    count, never read by the host); ``max_blocks`` is the host-side upper bound."""

    block_bank: torch.Tensor
    block_start: torch.Tensor
    block_count: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_bank.numel()


@dataclass(frozen=True)
class Launcher:
    """How one Triton kernel is launched. ``name``: the kernel's (what plans, reasons and
    tests speak of); ``launch(step, call)``: one launch on ``call``'s tensors;
    ``descriptors(step, weights, head_dim)``: the tensor descriptors the kernel reads, by
    operand, or None for a kernel that reads none (each one None where it cannot be made)."""

    name: str
    launch: Callable[["LaunchStep", "FusedCall"], None]
    descriptors: Callable[["LaunchStep", ExpertWeights, int], dict] | None = None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class LaunchStep:
    """One launch: its :class:`Launcher`, its grid (programs) and the tiles it runs with."""

    launcher: Launcher
    grid: int
    tiles: FusedTiles

    @property
    def kernel(self) -> str:
        """The Triton kernel's name."""
        return self.launcher.name


@dataclass
class FusedCall:
    """The tensors one run of a :class:`~.plan.LaunchPlan` reads and writes. ``schedule``: the
    block schedule's buffers (filled by the plan's schedule step, or already built; None
    without routes); ``rows`` ``[R, Dh]`` fp32 and ``slot_route`` ``[S*H*K]`` int32: the
    per-route rows and where each slot's row is; ``out``: the top-k sum's output; ``act``: the
    two-kernel path's activation buffer; ``descriptors``: per step, its tensor descriptors
    (:func:`~.descriptors.step_descriptors`; :func:`~.fused_prepare.expert_buffers` makes them
    and ``act`` where the plan needs them)."""

    x: torch.Tensor
    table: RouteTable
    weights: ExpertWeights
    config: MoEConfig
    workspace: FusedWorkspace | None
    schedule: BlockSchedule | None
    rows: torch.Tensor
    slot_route: torch.Tensor
    out: torch.Tensor | None = None
    act: torch.Tensor | None = None
    descriptors: dict | None = None

    def descriptors_of(self, step: LaunchStep) -> dict:
        """``step``'s descriptors; a clear error where the caller made none for it."""
        made = (self.descriptors or {}).get(step)
        if made is None:
            raise ValueError(f"call.descriptors has none for {step.kernel}: make them with "
                             f"descriptors.step_descriptors(plan.steps, ...)")
        return made


def dot_modes() -> tuple[bool, str]:
    """(UPCAST, DOT_PRECISION) of the GEMM kernels: under the interpreter, bf16 operands go to
    fp32 before each dot (its bf16 ``tl.dot`` is wrong, CONTRACT 8) with "ieee" dots."""
    upcast = interpreter_enabled()
    return upcast, "ieee" if upcast else "tf32"  # tf32 is never used: operands are 16-bit


def register_cap(maxnreg: int) -> dict:
    """The launch option capping registers per thread (none under the interpreter)."""
    return {"maxnreg": maxnreg} if maxnreg and not interpreter_enabled() else {}
