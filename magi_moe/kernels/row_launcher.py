"""The fused path's expert rows with a caller-owned accumulator: the huge-offset fuzzer's entry
to the fused GEMMs (``RowLauncher`` of the ``fused`` declaration), so tokens past 2^31 / row
stride run on lazily allocated memory with a handful of programs."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from ..routing import RouteTable
from .fused import launch_route_rows
from .tiles import choose_fused_tiles
from .workspace import shared_workspace


def launch_fused_rows(x, table: RouteTable, weights, config: MoEConfig, accumulator: torch.Tensor, *,
                      deterministic: bool = True) -> None:
    """The fused path's expert rows (``launch_route_rows``) into ``accumulator`` ``[R, Dh]``, with
    a lazily allocated ``slot_route`` ``[S*H*K]``; checks that every routed slot points at its
    route (only those pages are ever touched)."""
    slots = table.num_tokens * config.num_heads * config.top_k
    slot_route = torch.empty(slots, dtype=torch.int32, device=x.device)
    tiles = choose_fused_tiles(config, table.num_routes, x.device)
    launch_route_rows(x, table, weights, config, accumulator, slot_route, tiles=tiles,
                      workspace=shared_workspace(x.device))
    routes = torch.arange(table.num_routes, dtype=torch.int32, device=x.device)
    wrong = slot_route[table.route_slots] != routes
    if bool(wrong.any()):
        raise AssertionError(f"fused slot_route is wrong for {int(wrong.sum())} routed slots")
