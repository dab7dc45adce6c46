"""A second worked example of an outside implementation: one bank at a time, as a team's first
grouped-GEMM kernel often starts.

Where ``tests/outside_impl_example.py`` gathers every route's own weights (simple, but it moves
``Dh * I * 3`` weights per route and is too slow to benchmark at the docs/ANCHORS.md sizes), this
one walks the route table's CSR offsets on the host (one device-to-host copy per call) and runs
three fp32 GEMMs per routed bank on that bank's rows. The top-k sum adds the ``K`` routes of each
(token, head) in the order of ``k``, without atomics.

    pytest --impl magi_moe.tests.outside_grouped_example:IMPL
    python -m magi_moe.bench --anchors --impl magi_moe.tests.outside_grouped_example:IMPL
"""
import torch

from magi_moe.implementation import Implementation
from magi_moe.inputs import check_expert_inputs
from magi_moe.validation import check_out


def grouped_forward(x, table, weights, config, *, out):
    """``x [S, H*Dh]``, a magi_moe RouteTable, ExpertWeights, MoEConfig; writes all of ``out [S, H*Dh]``."""
    check_expert_inputs(x, table, weights, config, dtypes=(torch.bfloat16, torch.float32))
    check_out(out, x)
    S, H, E, K, Dh = x.shape[0], config.num_heads, config.num_experts, config.top_k, config.head_dim
    heads = x.unflatten(1, (H, Dh))
    offsets = table.offsets.tolist()  # the loop over banks runs on the host
    # one fp32 row per (token, head, k) slot; slots without a route add zero
    slots = torch.zeros(S * H * K, Dh, dtype=torch.float32, device=x.device)
    for bank in range(H * E):
        lo, hi = offsets[bank], offsets[bank + 1]
        if lo == hi:
            continue
        rows = heads[table.gather_ids[lo:hi].long(), bank // E].float()  # [n, Dh]
        g = (rows @ weights.w_gate[bank].float()).clamp(max=7.0)
        u = (rows @ weights.w_up[bank].float()).clamp(-7.0, 7.0)
        act = (g * torch.sigmoid(1.702 * g) * (u + 1)).to(x.dtype).float()  # SwiGLU7, rounded once
        down = act @ weights.w_down[bank].float()
        slots[table.route_slots[lo:hi]] = down * table.sorted_probs[lo:hi, None].float()
    per_k = slots.view(S * H, K, Dh)
    y = per_k[:, 0].clone()
    for k in range(1, K):  # the top-k sum in a fixed order
        y += per_k[:, k]
    out.copy_(y.view(S, H * Dh))  # one final rounding
    return out


IMPL = Implementation(
    name="torch-grouped",
    forward=grouped_forward,
    backends=("cpu", "cuda"),
    precision="bf16-fp32acc",  # bf16 operands, fp32 sums, one SwiGLU7 and one final rounding
    dtypes=(torch.bfloat16, torch.float32),
    # It calls check_expert_inputs first. Not "deterministic": BLAS's fp32 GEMMs on the CPU give
    # other bits with another thread count (the determinism property finds it). Not
    # "int64_offsets": its slot buffer holds S*H*K rows, which the huge-token cases cannot allocate.
    capabilities={"input_checks"},
    description="outside-implementation example: a per-bank loop of fp32 GEMMs (tests only)",
)
