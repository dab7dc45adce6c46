"""Pure-PyTorch emulations of the expert computation with chosen precision points.

``emulated_implementation()`` with its defaults follows the ``bf16-fp32acc`` model exactly
(bf16 operands upcast to fp32, so products are exact and sums are fp32; SwiGLU7 in fp32 rounded
once; down in fp32; routing weight and top-k sum in fp32; one final rounding): a CPU stand-in
for the fast paths. Its switches build the broken variants the auditors must flag
(``tests/audit_broken.py``): gate/up or down accumulated in the working dtype term by term, or
g and u rounded to the working dtype before SwiGLU7's clamp. A per-expert loop keeps it short.
"""
from __future__ import annotations

from typing import Literal

import torch

from magi_moe.reference import swiglu7
from magi_moe.registry import Implementation

Accumulation = Literal["fp32", "working"]


def accumulate_in_working_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` summed term by term in ``a.dtype``: every product and partial sum is rounded,
    as a kernel without an fp32 accumulator would. ``a`` ``[n, k]``, ``b`` ``[k, m]``."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    for d in range(a.shape[1]):
        acc = acc + a[:, d:d + 1] * b[d]
    return acc


def emulated_forward(x, table, weights, config, *, out, gate_up: Accumulation = "fp32",
                     down: Accumulation = "fp32", round_gate_up: bool = False) -> torch.Tensor:
    """The expert computation with the given precision points; writes ``out`` ``[S, H*Dh]``."""
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    work = x.dtype
    acc = torch.zeros(x.shape[0], H, Dh, dtype=torch.float32, device=x.device)
    offsets = table.offsets.tolist()
    for f in range(config.num_banks):
        lo, hi = offsets[f], offsets[f + 1]
        if lo == hi:
            continue
        h = f // E
        tokens = table.gather_ids[lo:hi].long()
        xs = x[tokens, h * Dh:(h + 1) * Dh]
        if gate_up == "fp32":
            g = xs.float() @ weights.w_gate[f].float()
            u = xs.float() @ weights.w_up[f].float()
        else:
            g = accumulate_in_working_dtype(xs, weights.w_gate[f]).float()
            u = accumulate_in_working_dtype(xs, weights.w_up[f]).float()
        if round_gate_up:
            g, u = g.to(work).float(), u.to(work).float()
        a = swiglu7(g, u).to(work)
        if down == "fp32":
            o = a.float() @ weights.w_down[f].float()
        else:
            o = accumulate_in_working_dtype(a, weights.w_down[f]).float()
        acc[:, h].index_add_(0, tokens, o * table.sorted_probs[lo:hi].float()[:, None])
    return out.copy_(acc.view(x.shape[0], H * Dh))


def emulated_implementation(name: str, *, gate_up: Accumulation = "fp32",
                            down: Accumulation = "fp32", round_gate_up: bool = False,
                            precision: str = "bf16-fp32acc", description: str = "",
                            capabilities=frozenset({"int64_offsets"})) -> Implementation:
    """An Implementation running :func:`emulated_forward` with these switches, *declaring*
    ``precision`` (a broken variant declares the model it fails to follow)."""
    def forward(x, table, weights, config, *, out):
        return emulated_forward(x, table, weights, config, out=out, gate_up=gate_up, down=down,
                                round_gate_up=round_gate_up)
    return Implementation(
        name, forward, ("cpu", "interpret", "cuda"), precision,
        dtypes=(torch.bfloat16, torch.float16, torch.float32), capabilities=capabilities,
        description=description or (f"PyTorch emulation: gate/up accumulated in {gate_up}, down in "
                                    f"{down}, g/u rounded before SwiGLU7: {round_gate_up}"))


FP32ACC_EMULATION = emulated_implementation(
    "fp32acc-emulation",
    description="PyTorch emulation of the bf16-fp32acc precision points (fp32 accumulation)")


def negative_controls() -> tuple[Implementation, ...]:
    """Emulations that declare ``bf16-fp32acc`` and break it: ``python -m audit`` runs them and
    fails if the error-bound auditor lets any through (it would have lost its power)."""
    return (
        emulated_implementation("control-bf16-gate-up", gate_up="working",
                                description="gate/up summed in bf16 term by term"),
        emulated_implementation("control-bf16-down", down="working",
                                description="down projection summed in bf16 term by term"),
        emulated_implementation("control-round-gate-up", round_gate_up=True,
                                description="g, u rounded to bf16 before SwiGLU7"),
    )
