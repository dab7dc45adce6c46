"""The whole layer on the fused path: the inputs checked once, the host work done once
(:mod:`.fused_prepare`), then the fused router's launches, then the fused expert kernels'."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .expert_mlp import compiled_shared_memory
from .fused import run_plan
from .fused_inputs import check_layer_inputs
from .fused_prepare import prepare_layer
from .router import launch_router
from .launch_steps import FusedCall
from .workspace import FusedWorkspace


def fused_layer_forward(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                        weights, config: MoEConfig, *, out: torch.Tensor | None = None,
                        workspace: FusedWorkspace | None = None) -> torch.Tensor:
    """:func:`~.fused_inputs.check_layer_inputs`, :func:`~.fused_prepare.prepare_layer` (tiles,
    plan, buffers), :func:`~magi_moe.kernels.router.launch_router` (which also builds the
    block schedule), then :func:`~magi_moe.kernels.fused.run_plan`. Seven launches, no host
    synchronisation, no allocation once warm except ``out`` when not given."""
    check_layer_inputs(x, gate, bias, weights, config, out)
    S, D = x.shape
    if out is None:
        out = torch.empty(S, D, dtype=x.dtype, device=x.device)
    if S == 0:
        return out
    launch = prepare_layer(config, S, x.device, x.dtype, weights, workspace,
                           shared_memory_of=compiled_shared_memory(weights, config)
                           if x.device.type == "cuda" else None)
    b = launch.buffers
    routes = launch_router(x, gate, bias, config, launch.routing_tiles, b.workspace,
                           launch.plan.asked.block_m)
    # The table was built on the device just now and nothing ran since: no value check (it
    # would cost a sync), also for inference tensors, whose changes no version counter records.
    run_plan(launch.plan, FusedCall(x, routes.table, weights, config, b.workspace,
                                    routes.schedule, b.rows, b.slot_route, out, b.act,
                                    b.descriptors))
    return out
