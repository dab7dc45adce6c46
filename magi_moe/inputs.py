"""Checks of one expert-computation call ``(x, table, weights, config)``, shared by every path."""
from __future__ import annotations

import torch

from .config import MoEConfig
from .routing import RouteTable, check_table_bounds
from .validation import check_same_device, check_tensor
from .weights import ExpertWeights

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_expert_inputs(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                        config: MoEConfig, *, dtypes=FLOAT_DTYPES, check_bounds: bool = True) -> None:
    """Shapes, dtypes, devices and index bounds; raises naming the argument.

    ``check_bounds`` reads the table's indices (one host sync). Only a caller that built the
    table itself on the device (the fused layer path) may skip it: a hand-built table with an
    out-of-range index would otherwise send a kernel to a wild address."""
    check_tensor("x", x, shape=(table.num_tokens, config.hidden_size), dtype=dtypes)
    weights.check(config)
    if weights.w_gate.dtype != x.dtype:
        raise ValueError(f"weights dtype {weights.w_gate.dtype} must match x dtype {x.dtype}")
    check_tensor("table.gather_ids", table.gather_ids, shape=(None,), dtype=torch.int32)
    check_tensor("table.sorted_probs", table.sorted_probs, shape=(None,),
                 dtype=(torch.float32, torch.float64))
    check_tensor("table.offsets", table.offsets, shape=(config.num_banks + 1,), dtype=torch.int64)
    check_tensor("table.route_slots", table.route_slots, shape=(None,), dtype=torch.int64)
    check_same_device(x=x, w_gate=weights.w_gate, gather_ids=table.gather_ids,
                      sorted_probs=table.sorted_probs, offsets=table.offsets,
                      route_slots=table.route_slots)
    if (table.num_heads, table.num_experts, table.top_k) != (
            config.num_heads, config.num_experts, config.top_k):
        raise ValueError(f"table was built for H={table.num_heads} E={table.num_experts} "
                         f"K={table.top_k}, config has H={config.num_heads} "
                         f"E={config.num_experts} K={config.top_k}")
    if check_bounds:
        check_table_bounds(table, config.num_banks)
