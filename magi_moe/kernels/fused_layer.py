"""The whole layer on the fused path: the fused router, then the fused expert kernels."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from .fused import fused_forward
from .fused_routing import fused_route
from .tiles import choose_fused_tiles
from .workspace import FusedWorkspace, shared_workspace


def fused_layer_forward(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                        weights, config: MoEConfig, *, out: torch.Tensor | None = None,
                        workspace: FusedWorkspace | None = None) -> torch.Tensor:
    """:func:`~magi_moe.kernels.fused_routing.fused_route` (which also builds the block
    schedule) then :func:`~magi_moe.kernels.fused.fused_forward`. Seven launches, no host
    synchronisation, no allocation once warm except ``out`` when not given."""
    workspace = workspace or shared_workspace(x.device)
    tiles = choose_fused_tiles(config, x.shape[0] * config.num_heads * config.top_k, x.device)
    routes = fused_route(x, gate, bias, config, block_m=tiles.block_m, workspace=workspace)
    # The table was built on the device just now and nothing ran since: no value check (it
    # would cost a sync), also for inference tensors, whose changes no version counter records.
    return fused_forward(x, routes.table, weights, config, out=out, tiles=tiles,
                         workspace=workspace, schedule=routes.schedule, check_bounds=False)
