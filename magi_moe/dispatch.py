"""Which implementation the layer runs. One written policy:

1. Plain CPU tensors without the Triton interpreter: ``reference`` (the float64 oracle, rounded
   to the input dtype) -- there is no compiled kernel to run.
2. CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``: the native Triton kernel;
   ``native-det`` when deterministic mode is asked for, else ``native``.
3. Dtypes the kernels do not declare (float64): ``reference``.

The fused path will join this policy with its own measured thresholds.
"""
from __future__ import annotations

import torch

from .backends import interpreter_enabled, triton_installed
from .registry import Implementation, get_implementation


def choose_implementation(device: torch.device, dtype: torch.dtype, *,
                          deterministic: bool = False) -> Implementation:
    kernels_run_here = triton_installed() and (
        device.type == "cuda" or (device.type == "cpu" and interpreter_enabled()))
    if kernels_run_here and dtype in (torch.bfloat16, torch.float16, torch.float32):
        return get_implementation("native-det" if deterministic else "native")
    return get_implementation("reference")
