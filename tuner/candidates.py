"""The tile candidates the tuner times, per kernel, as :class:`~magi_moe.kernels.tiles.FusedTiles`
(or :class:`~magi_moe.kernels.tiles.RoutingTiles`) fields. Each group's first candidate per
block size is the reference the others' outputs are checked against (:mod:`.sweep`)."""
from __future__ import annotations

# Gate/up candidates, each with the programs per SM to try: "kloop" loops over Dh per column
# tile (kernels/gate_up_down.py). Earlier forms (docs/PERFORMANCE.md) also tried flattened
# loops, "wide" kernels that loaded a block's x rows once, BK=16, 64x256 tiles, register caps,
# Triton's warp specialisation (wrong outputs on Triton 3.6) and the two kernels with operands
# by tensor descriptor (x rows gathered first, the activation stored by descriptor): slower than
# the one-kernel step or wrong, dropped (their kernels with them).
def _gu(variant, bm, bn, bk, warps, stages, ppsm=(1, 2), maxnreg=0):
    tiles = dict(gu_variant=variant, block_m=bm, gu_block_n=bn, gu_block_k=bk, gu_warps=warps,
                 gu_stages=stages, **({"gu_maxnreg": maxnreg} if maxnreg else {}))
    return [{**tiles, "gu_programs_per_sm": p} for p in ppsm]


def _dn(bm, bn, bk, warps, stages, ppsm=(1, 2)):
    return [dict(block_m=bm, down_block_n=bn, down_block_k=bk, down_warps=warps,
                 down_stages=stages, down_programs_per_sm=p) for p in ppsm]


GATE_UP_CANDIDATES = tuple(c for group in (
    # the pointer-load winner: each block size's first candidate is the reference
    # the others are checked against
    _gu("kloop", 64, 128, 32, 4, 5, (2,)),
    _gu("kloop", 128, 128, 32, 8, 4, (1,)),
) for c in group)
# Gate/up and down in one work item ("mlp_tma"): timed against the best gate/up + down pair.
MLP_CANDIDATES = tuple(c for group in (
    _gu("mlp_tma", 64, 32, 256, 4, 3, (1,)), _gu("mlp_tma", 64, 32, 256, 4, 4, (1,)),
    _gu("mlp_tma", 64, 16, 256, 4, 4, (1,)),
    # one warpgroup, two programs per SM (about 104 KiB of shared memory each): small banks
    _gu("mlp_tma", 64, 16, 256, 4, 3, (2,)), _gu("mlp_tma", 64, 64, 256, 4, 2, (1,)),
    # two warpgroups, one per 64 rows: the activation stays in the warpgroup that made it
    _gu("mlp_tma", 128, 32, 256, 8, 3, (1,)), _gu("mlp_tma", 128, 32, 256, 8, 2, (1,)),
    _gu("mlp_tma", 128, 16, 256, 8, 4, (1,)),
) for c in group)
# Timed on the H200 and dropped (docs/PERFORMANCE.md, "The one-kernel loop"): 64 rows on two warpgroups (each MMA
# split along N), 2.9-3.3x slower than on one, with or without a 128-register cap and two
# programs per SM; x as the gate/up MMAs' register operand, and gate and up as one dot of twice
# the columns, 10-25% slower than the forms above.
DOWN_CANDIDATES = tuple(c for group in (
    _dn(64, 128, 64, 4, 4, (2,)), _dn(128, 256, 64, 8, 3, (1,)),
) for c in group)
SUM_CANDIDATES = ((8, 4), (16, 4), (32, 4), (32, 8))
ROUTING_CANDIDATES = (  # (block_s, block_d, warps, place_warps)
    (16, 64, 4, 4), (32, 64, 4, 4), (32, 64, 8, 8), (16, 32, 4, 4), (32, 32, 8, 4), (32, 32, 4, 4),
    # more tokens per program (the head's gate, 256 KiB in fp32, is read once per token block)
    # and shorter gate slices: slower on the H200 (docs/PERFORMANCE.md), kept for other GPUs;
    # 16-warp forms with 64-128 tokens (5-9x slower, or over shared memory) were dropped
    (64, 32, 8, 4), (32, 16, 8, 4),
)


SWEPT_KERNELS = ("gate_up", "down", "mlp", "sum", "routing")
