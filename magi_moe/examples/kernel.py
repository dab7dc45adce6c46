"""A worked kernel implementation: the adapter a kernel team writes (``magi-moe example kernel``).

PyTorch stands in for the kernel: one loop over the expert banks of the route table, each bank's
routes gathered and multiplied in fp32 on the input's values. Copy this file next to your code,
replace the body of ``loop_forward`` with a call to your kernel, and run

    magi-moe check kernel:IMPL --backend cpu      # from the directory holding kernel.py

What it shows: the ``forward`` signature and what each argument holds, checking the call first
(so the conformance suite's bad-input tables can hold it to ``input_checks``), writing every
element of ``out`` and returning ``out`` itself, the precision points of ``bf16-fp32acc``, and
the declaration.
"""
import torch

from magi_moe.implementation import Implementation
from magi_moe.inputs import check_expert_inputs
from magi_moe.validation import check_out


def swiglu7(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """CONTRACT section 1's activation, in the precision of its arguments (fp32 here)."""
    gate = gate.clamp(max=7.0)
    up = up.clamp(-7.0, 7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def loop_forward(x, table, weights, config, *, out):
    """The expert part of the layer on routes already chosen.

    ``x`` ``[S, H*Dh]`` (a strided view is allowed; ``S`` may be 0); ``table`` a
    ``magi_moe.routing.RouteTable``: the routes of bank ``f = h*E + e`` are
    ``offsets[f]:offsets[f+1]``, with their token (``gather_ids``), routing weight
    (``sorted_probs``, fp32, normalised and scaled already) and place ``(s*H + h)*K + k`` in
    ``[S, H, K]`` (``route_slots``); ``weights`` the released layout ``w_gate``/``w_up``
    ``[H*E, Dh, I]`` and ``w_down`` ``[H*E, I, Dh]``; ``out`` ``[S, H*Dh]`` in
    ``IMPL.output_dtype(x.dtype)``, allocated by the caller and filled with NaN by the tests.
    """
    check_expert_inputs(x, table, weights, config, dtypes=IMPL.dtypes)  # errors name the argument
    check_out(out, x)
    H, E, K, Dh = config.num_heads, config.num_experts, config.top_k, config.head_dim
    S = x.shape[0]
    heads = x.unflatten(1, (H, Dh))                                      # [S, H, Dh], a view
    slots = torch.zeros(S * H * K, Dh, dtype=torch.float32, device=x.device)  # one row per route
    offsets = table.offsets.tolist()                                     # one host read per call
    for f in range(H * E):
        lo, hi = offsets[f], offsets[f + 1]
        if lo == hi:  # most banks get no route: they cost nothing and write nothing
            continue
        rows = heads[table.gather_ids[lo:hi].long(), f // E].float()    # [R_f, Dh]
        gate = rows @ weights.w_gate[f].float()                          # fp32 accumulation
        up = rows @ weights.w_up[f].float()
        act = swiglu7(gate, up).to(x.dtype).float()                      # rounded once to x's dtype
        down = act @ weights.w_down[f].float()
        slots[table.route_slots[lo:hi]] = down * table.sorted_probs[lo:hi, None]  # weight in fp32
    # The top-k sum in the order of k, in fp32, for every (token, head): bitwise reproducible
    # without atomics (hence "deterministic"), and zero for a pair with no route.
    summed = slots.view(S, H, K, Dh).sum(dim=2)
    out.copy_(summed.flatten(1))                                         # one final rounding
    return out                                                           # out itself, never a copy


IMPL = Implementation(
    name="example-loop",
    forward=loop_forward,
    backends=("cpu", "cuda"),        # plain PyTorch: runs on CPU and GPU tensors
    precision="bf16-fp32acc",        # bf16 operands, fp32 sums, SwiGLU7 and the output rounded once
    dtypes=(torch.bfloat16,),        # the input dtypes it accepts
    capabilities={"deterministic", "input_checks"},  # only what is true: each is tested
    description="worked example (magi-moe example kernel): a per-bank loop in PyTorch",
)
