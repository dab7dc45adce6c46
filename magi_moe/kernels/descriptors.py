"""Tensor descriptors (TMA) over the fused path's banked weights, and why one cannot be made:
the launch planner asks :func:`banked_problem` before anything launches;
:func:`step_descriptors` makes the descriptors the plan promised (each step's
:class:`~.launch_steps.Launcher` says which), before the first launch.

A banked weight ``[banks, rows, cols]`` is viewed as 2-D ``[banks * rows, cols]`` through its
strides, so a tile at ``(bank * rows + k, n)`` never crosses a bank (the reductions are whole
multiples of the tile). Descriptor coordinates are int32: the row counts stay below 2^31.
"""
from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..weights import ExpertWeights
from .launch_steps import LaunchStep


def banked_problem(w: torch.Tensor) -> str | None:
    """Why no descriptor can view ``w`` ``[banks, rows, cols]`` as ``[banks * rows, cols]``,
    or None when one can."""
    banks, rows, _ = w.shape
    strides = w.stride()
    row_bytes = strides[1] * w.element_size()
    if strides[2] != 1:
        return f"last dim not contiguous (strides {strides})"
    if strides[0] != rows * strides[1]:
        return f"banks not evenly spaced by rows (strides {strides})"
    if banks * rows >= 2**31:
        return f"{banks * rows} rows >= 2^31"
    if row_bytes % 16:
        return f"row stride of {row_bytes} bytes not a multiple of 16"
    if w.data_ptr() % 16:
        return "base address not 16-byte aligned"
    return None


def banked_descriptor(w: torch.Tensor, block_shape: list[int]) -> TensorDescriptor | None:
    """A 2-D descriptor ``[banks * rows, cols]`` over a ``[banks, rows, cols]`` weight read
    through its strides, or None when :func:`banked_problem` finds a reason."""
    if banked_problem(w) is not None:
        return None
    banks, rows, cols = w.shape
    return TensorDescriptor(w, [banks * rows, cols], [w.stride(1), 1], block_shape)


def step_descriptors(steps: tuple[LaunchStep, ...], weights: ExpertWeights,
                     head_dim: int) -> dict[LaunchStep, dict]:
    """Every tensor descriptor a plan's ``steps`` read, by step and operand (the steps whose
    launcher reads any). The plan checked the same layouts, so one that cannot be made is a
    bug, never a silent fallback."""
    made = {step: step.launcher.descriptors(step, weights, head_dim)
            for step in steps if step.launcher.descriptors is not None}
    for step, descs in made.items():
        if any(d is None for d in descs.values()):
            raise RuntimeError(f"{step.kernel}: the launch plan promised tensor descriptors that "
                               f"cannot be made")
    return made
