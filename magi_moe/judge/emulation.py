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

from magi_moe.reference import PrecisionFaults, expert_reference
from magi_moe.registry import Implementation

Accumulation = Literal["fp32", "working"]


def emulated_forward(x, table, weights, config, *, out, gate_up: Accumulation = "fp32",
                     down: Accumulation = "fp32", round_gate_up: bool = False) -> torch.Tensor:
    """The expert computation with the given precision points; writes ``out`` ``[S, H*Dh]``.
    The reference's ``fp32acc`` emulation with :class:`~magi_moe.reference.PrecisionFaults`."""
    faults = PrecisionFaults(gate_up_in_working_dtype=gate_up == "working",
                             down_in_working_dtype=down == "working", round_gate_up=round_gate_up)
    return out.copy_(expert_reference(x, table, weights, config, precision="fp32acc", faults=faults))


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
