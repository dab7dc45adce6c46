"""The host side of one fused layer call, done before its first launch: the tiles, the launch plan
and every workspace buffer the expert launches use, in one frozen record (:class:`LayerLaunch`).

It reads the problem's sizes, the device, the dtype and the weights' layout, never ``x`` (its
values are the kernels' business); :func:`~.fused_layer.fused_layer_forward` checks the inputs
first and then launches the router and the plan on this record. ``fused_call``
(:mod:`.fused`) takes its buffers through :func:`expert_buffers` too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import MoEConfig
from ..weights import ExpertWeights
from .device import device_facts
from .plan import GATE_UP_TMA, GATHER_ROWS, LaunchPlan, LaunchStep, plan_fused
from .schedule import BlockSchedule, schedule_buffers
from .tiles import RoutingTiles, choose_layer_tiles
from .workspace import FusedWorkspace, shared_workspace


@dataclass(frozen=True)
class ExpertBuffers:
    """Workspace views the expert launches write and read: ``schedule`` the block schedule's
    buffers (None without routes); ``rows`` ``[R, Dh]`` fp32 and ``slot_route`` ``[S*H*K]``
    int32, the per-route rows and where each slot's row is; ``act``: the two-kernel path's
    activation buffer and ``gathered``: the ``tma_gathered`` variant's x rows, each None where
    the plan has no such step."""

    schedule: BlockSchedule | None
    rows: torch.Tensor
    slot_route: torch.Tensor
    act: torch.Tensor | None
    gathered: torch.Tensor | None


def expert_buffers(workspace: FusedWorkspace, plan: LaunchPlan, config: MoEConfig,
                   num_tokens: int, num_routes: int, dtype: torch.dtype,
                   schedule: BlockSchedule | None = None, *, rows: torch.Tensor | None = None,
                   slot_route: torch.Tensor | None = None) -> ExpertBuffers:
    """The buffers ``plan``'s launches use, each taken once per call (under
    :func:`magi_moe.debug.poison_workspaces` a second request would re-poison it).
    ``schedule``, ``rows``, ``slot_route``: the caller's own (then not taken)."""
    if schedule is None and num_routes:
        schedule = schedule_buffers(workspace, num_routes, config.num_banks, plan.asked.block_m)
    if rows is None:
        rows = workspace.get("rows", (num_routes, config.head_dim), torch.float32)
    if slot_route is None:
        slot_route = workspace.get("slot_route", (num_tokens * config.num_heads * config.top_k,),
                                   torch.int32)
    act = (workspace.get("act", (plan.activation_rows, config.intermediate_size), dtype)
           if plan.activation_rows else None)
    gather = next((s for s in plan.steps if s.kernel in (GATHER_ROWS, GATE_UP_TMA)
                   and s.tiles.gu_variant == "tma_gathered"), None)
    gathered = (workspace.get("x_gathered", (plan.max_blocks * gather.tiles.block_m,
                                             config.head_dim), dtype)
                if gather is not None else None)
    return ExpertBuffers(schedule, rows, slot_route, act, gathered)


@dataclass(frozen=True)
class LayerLaunch:
    """Everything one fused layer call launches with, decided and taken on the host before the
    first launch: the router's fitted tiles, the expert launches' plan, the workspace and the
    expert buffers (views valid until the workspace's next call on this device)."""

    routing_tiles: RoutingTiles
    plan: LaunchPlan
    workspace: FusedWorkspace
    buffers: ExpertBuffers


def prepare_layer(config: MoEConfig, num_tokens: int, device: torch.device, dtype: torch.dtype,
                  weights: ExpertWeights, workspace: FusedWorkspace | None = None, *,
                  shared_memory_of: Callable[[LaunchStep], int] | None = None) -> LayerLaunch:
    """The :class:`LayerLaunch` of a layer call on ``num_tokens`` tokens (at least one) of
    ``dtype`` on ``device``: tiles from the table for its route count, the plan for this
    device's facts (``shared_memory_of``: see :func:`~.plan.plan_fused`), with the block schedule
    built by the router, and the buffers."""
    num_routes = num_tokens * config.num_heads * config.top_k
    routing_tiles, tiles = choose_layer_tiles(config, num_routes, device)
    plan = plan_fused(config, num_tokens, num_routes, tiles, device_facts(device), weights,
                      schedule_built=True, shared_memory_of=shared_memory_of)
    workspace = workspace or shared_workspace(device)
    workspace.note_capture()
    buffers = expert_buffers(workspace, plan, config, num_tokens, num_routes, dtype)
    return LayerLaunch(routing_tiles, plan, workspace, buffers)
