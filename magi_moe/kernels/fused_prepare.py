"""The host side of one fused layer call, done before its first launch: the tiles, the launch plan,
the workspace buffers and tensor descriptors the expert launches use, in one frozen record
(:class:`LayerLaunch`).

It reads the problem's sizes, the device, the dtype and the weights' layout, never ``x`` (its
values are the kernels' business); :func:`~.fused_layer.fused_layer_forward` checks the inputs
first and then launches the router and the plan on this record. The block schedule's buffers
are the router's to take: it builds the schedule. ``fused_call`` (:mod:`.fused`) takes its
buffers through :func:`expert_buffers` too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import MoEConfig
from ..weights import ExpertWeights
from .descriptors import step_descriptors
from .device import device_facts
from .launch_steps import LaunchStep
from .plan import LaunchPlan, plan_fused
from .tiles import RoutingTiles, choose_layer_tiles
from .workspace import FusedWorkspace, shared_workspace


@dataclass(frozen=True)
class ExpertBuffers:
    """What the expert launches use besides their inputs: ``workspace`` (whose views the
    buffers are), ``rows`` ``[R, Dh]`` fp32 and ``slot_route`` ``[S*H*K]`` int32 (the
    per-route rows and where each slot's row is), ``act`` (the two-kernel path's activation
    buffer, None where the plan has no such path) and ``descriptors``,
    :func:`~.descriptors.step_descriptors`'s."""

    workspace: FusedWorkspace
    rows: torch.Tensor
    slot_route: torch.Tensor
    act: torch.Tensor | None
    descriptors: dict[LaunchStep, dict]


def expert_buffers(workspace: FusedWorkspace | None, device: torch.device, plan: LaunchPlan,
                   weights: ExpertWeights, config: MoEConfig, num_tokens: int, num_routes: int,
                   dtype: torch.dtype, *, rows: torch.Tensor | None = None,
                   slot_route: torch.Tensor | None = None) -> ExpertBuffers:
    """The buffers and descriptors ``plan``'s launches use, from ``workspace`` (by default the
    device's shared one), each buffer taken once per call (under
    :func:`magi_moe.debug.poison_workspaces` a second request would re-poison it). ``rows``,
    ``slot_route``: the caller's own (then not taken). The block schedule is not among them:
    whoever builds it takes it (:func:`~.schedule.schedule_buffers`)."""
    workspace = workspace or shared_workspace(device)
    workspace.note_capture()
    if rows is None:
        rows = workspace.get("rows", (num_routes, config.head_dim), torch.float32)
    if slot_route is None:
        slot_route = workspace.get("slot_route", (num_tokens * config.num_heads * config.top_k,),
                                   torch.int32)
    act = (workspace.get("act", (plan.activation_rows, config.intermediate_size), dtype)
           if plan.activation_rows else None)
    descriptors = step_descriptors(plan.steps, weights, config.head_dim)
    return ExpertBuffers(workspace, rows, slot_route, act, descriptors)


@dataclass(frozen=True)
class LayerLaunch:
    """Everything one fused layer call launches with, decided and taken on the host before the
    first launch: the router's fitted tiles, the expert launches' plan and their buffers
    (views valid until the workspace's next call on this device)."""

    routing_tiles: RoutingTiles
    plan: LaunchPlan
    buffers: ExpertBuffers


def prepare_layer(config: MoEConfig, num_tokens: int, device: torch.device, dtype: torch.dtype,
                  weights: ExpertWeights, workspace: FusedWorkspace | None = None, *,
                  shared_memory_of: Callable[[LaunchStep], int] | None = None) -> LayerLaunch:
    """The :class:`LayerLaunch` of a layer call on ``num_tokens`` tokens (at least one) of
    ``dtype`` on ``device``: tiles from the table for its route count, the plan for this
    device's facts (``shared_memory_of``: see :func:`~.plan.plan_fused`), with the block schedule
    left to the router, and the buffers."""
    num_routes = num_tokens * config.num_heads * config.top_k
    routing_tiles, tiles = choose_layer_tiles(config, num_routes, device)
    facts = device_facts(device)
    plan = plan_fused(config, num_tokens, num_routes, tiles, facts, weights,
                      schedule_built=True, shared_memory_of=shared_memory_of)
    buffers = expert_buffers(workspace, device, plan, weights, config, num_tokens, num_routes,
                             dtype)
    return LayerLaunch(routing_tiles, plan, buffers)
