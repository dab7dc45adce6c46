"""A worked example of an outside implementation: the adapter a kernel team would write.

It is deliberately written unlike magi-moe's reference (a per-expert loop): every route gathers
its own token row and its expert's weights, and batched einsums compute all routes at once.
The top-k sum adds the routes of each (token, head) in the order of ``k``, so the output is
bitwise reproducible without atomics.

Run the suite against it:  ``pytest --impl magi_moe.tests.outside_impl_example:IMPL``
"""
import torch

from magi_moe.implementation import Implementation
from magi_moe.inputs import check_expert_inputs
from magi_moe.validation import check_out

CHUNK_BYTES = 64 << 20  # fp32 weights gathered per batch of routes: bounds memory at wide shapes


def einsum_forward(x, table, weights, config, *, out):
    """``x [S, H*Dh]``, a magi_moe RouteTable, ExpertWeights, MoEConfig; writes all of ``out [S, H*Dh]``.

    Memory grows with the routes, not the tokens: huge inputs with few routes stay cheap.
    """
    # bad input gets an error naming the argument (the conformance suite's error-input table)
    check_expert_inputs(x, table, weights, config, dtypes=(torch.bfloat16, torch.float32))
    check_out(out, x)
    H, E, K, Dh = config.num_heads, config.num_experts, config.top_k, config.head_dim
    bank = torch.repeat_interleave(torch.arange(H * E, device=x.device), table.counts())  # [R]
    rows = x.unflatten(1, (H, Dh))[table.gather_ids.long(), bank // E].float()  # [R, Dh]
    pair, rank = table.route_slots // K, table.route_slots % K  # route -> (s*H + h), k
    pairs, pair_index = torch.unique(pair, return_inverse=True)  # the routed (token, head) pairs
    contrib = torch.empty(table.num_routes, Dh, dtype=torch.float32, device=x.device)
    chunk = max(1, CHUNK_BYTES // (3 * Dh * config.intermediate_size * 4))
    for lo in range(0, table.num_routes, chunk):
        f, xr = bank[lo:lo + chunk], rows[lo:lo + chunk]
        g = torch.einsum("rd,rdi->ri", xr, weights.w_gate[f].float()).clamp(max=7.0)
        u = torch.einsum("rd,rdi->ri", xr, weights.w_up[f].float()).clamp(-7.0, 7.0)
        act = (g * torch.sigmoid(1.702 * g) * (u + 1)).to(x.dtype).float()  # SwiGLU7, rounded once
        down = torch.einsum("ri,rid->rd", act, weights.w_down[f].float())
        contrib[lo:lo + chunk] = down * table.sorted_probs[lo:lo + chunk, None].float()
    acc = torch.zeros(pairs.numel(), Dh, dtype=torch.float32, device=x.device)
    for k in range(K):  # top-k sum in a fixed order; each pair occurs once per k, so no collisions
        chosen = rank == k
        acc[pair_index[chosen]] += contrib[chosen]
    out.zero_()  # (token, head) pairs without routes
    out.unflatten(1, (H, Dh))[pairs // H, pairs % H] = acc.to(out.dtype)  # one final rounding
    return out


IMPL = Implementation(
    name="torch-einsum",
    forward=einsum_forward,
    backends=("cpu", "cuda"),
    precision="bf16-fp32acc",  # bf16 operands, fp32 sums, one SwiGLU7 and one final rounding
    dtypes=(torch.bfloat16, torch.float32),
    # slots, not atomics; int64 indexing; it calls check_expert_inputs first
    capabilities={"deterministic", "int64_offsets", "input_checks"},
    description="outside-implementation example: per-route gather and batched einsums (tests only)",
)
