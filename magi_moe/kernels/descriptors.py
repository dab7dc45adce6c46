"""Tensor descriptors (TMA) over the fused path's weights and buffers, and why one cannot be
made: the launch planner asks :func:`banked_problem` / :func:`matrix_problem` before anything
launches; :func:`step_descriptors` makes the descriptors the plan promised, before the first
launch.

A banked weight ``[banks, rows, cols]`` is viewed as 2-D ``[banks * rows, cols]`` through its
strides, so a tile at ``(bank * rows + k, n)`` never crosses a bank (the reductions are whole
multiples of the tile). Descriptor coordinates are int32: the row counts stay below 2^31.
"""
from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..weights import ExpertWeights
from .launch_steps import DOWN_TMA, EXPERT_MLP, GATE_UP_TMA, LaunchStep


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


def matrix_rows_problem(rows: int) -> str | None:
    """Why a row-major buffer of ``rows`` rows cannot be a descriptor's source, or None."""
    return f"{rows} rows >= 2^31" if rows >= 2**31 else None


def matrix_problem(t: torch.Tensor) -> str | None:
    """Why no descriptor can address the 2-D row-major ``t``, or None when one can."""
    if t.stride(1) != 1:
        return f"last dim not contiguous (strides {tuple(t.stride())})"
    if (t.stride(0) * t.element_size()) % 16:
        return f"row stride of {t.stride(0) * t.element_size()} bytes not a multiple of 16"
    if t.data_ptr() % 16:
        return "base address not 16-byte aligned"
    return matrix_rows_problem(t.shape[0])


def banked_descriptor(w: torch.Tensor, block_shape: list[int]) -> TensorDescriptor | None:
    """A 2-D descriptor ``[banks * rows, cols]`` over a ``[banks, rows, cols]`` weight read
    through its strides, or None when :func:`banked_problem` finds a reason."""
    if banked_problem(w) is not None:
        return None
    banks, rows, cols = w.shape
    return TensorDescriptor(w, [banks * rows, cols], [w.stride(1), 1], block_shape)


def matrix_descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor | None:
    """A descriptor over a 2-D row-major tensor, or None where TMA cannot address it."""
    if matrix_problem(t) is not None:
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block_shape)


def step_descriptors(steps: tuple[LaunchStep, ...], weights: ExpertWeights, head_dim: int,
                     act: torch.Tensor | None, gathered: torch.Tensor | None) -> dict[str, dict]:
    """Every tensor descriptor a plan's ``steps`` read, by kernel and operand: over the weights
    and over the ``act`` and ``gathered`` buffers. The plan checked the same layouts, so one
    that cannot be made is a bug, never a silent fallback."""
    w = weights
    made: dict[str, dict] = {}
    for step in steps:
        t = step.tiles
        if step.kernel == EXPERT_MLP:
            made[EXPERT_MLP] = {"w_gate": banked_descriptor(w.w_gate, [head_dim, t.gu_block_n]),
                                "w_up": banked_descriptor(w.w_up, [head_dim, t.gu_block_n]),
                                "w_down": banked_descriptor(w.w_down, [t.gu_block_n, head_dim])}
        elif step.kernel == GATE_UP_TMA:
            bk, bn = t.gu_block_k, t.gu_block_n
            descs = {"w_gate": banked_descriptor(w.w_gate, [bk, bn]),
                     "w_up": banked_descriptor(w.w_up, [bk, bn])}
            if t.gu_variant == "tma_gathered":
                descs["x"] = matrix_descriptor(gathered, [t.block_m, bk])
            if t.gu_act_store == "tma":
                descs["act"] = matrix_descriptor(act, [t.block_m, bn])
            made[GATE_UP_TMA] = descs
        elif step.kernel == DOWN_TMA:
            made[DOWN_TMA] = {"act": matrix_descriptor(act, [t.block_m, t.down_block_k]),
                              "w_down": banked_descriptor(w.w_down,
                                                          [t.down_block_k, t.down_block_n])}
    for kernel, descs in made.items():
        if any(d is None for d in descs.values()):
            raise RuntimeError(f"{kernel}: the launch plan promised tensor descriptors that "
                               f"cannot be made")
    return made
