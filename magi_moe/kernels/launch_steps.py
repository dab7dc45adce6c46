"""A launch of the fused path: :class:`LaunchStep`, and the names of the Triton kernels a step
runs. The planner (:mod:`.plan`, which hands them on), the launchers (:mod:`.fused`) and the
descriptor maker (:mod:`.descriptors`) all speak of steps in these terms."""
from __future__ import annotations

from dataclasses import dataclass

from .tiles import FusedTiles

SCHEDULE = "block_schedule_kernel"
EXPERT_MLP = "expert_mlp_tma_kernel"
GATHER_ROWS = "gather_rows_kernel"
GATE_UP = "gate_up_kernel"
GATE_UP_TMA = "gate_up_tma_kernel"
DOWN = "down_kernel"
DOWN_TMA = "down_tma_kernel"
TOPK_SUM = "topk_sum_kernel"


@dataclass(frozen=True)
class LaunchStep:
    """One launch: the Triton kernel's name, its grid (programs) and the tiles it runs with
    (for ``gate_up_tma_kernel`` the variant, ``tma`` or ``tma_gathered``, and the activation
    store are the tiles' ``gu_variant`` and ``gu_act_store``)."""

    kernel: str
    grid: int
    tiles: FusedTiles
