"""Which implementation the layer runs. One written policy:

1. Plain CPU tensors without the Triton interpreter: ``reference`` (the float64 oracle, rounded
   to the input dtype) -- there is no compiled kernel to run.
2. Dtypes the fused path does not declare (it takes bf16 and fp16): ``native`` (``native-det``
   in deterministic mode) for fp32; ``reference`` for float64.
3. Inside ``torch.compile`` tracing: ``fused`` only while it declares ``compilable`` (its
   layer reaches the compiler as one opaque operator, kernels/fused_op.py), else ``native`` /
   ``native-det``.
4. Otherwise -- CUDA, or CPU with ``TRITON_INTERPRET=1``, bf16/fp16 -- ``fused``, at every token
   count and in deterministic mode too: it has no atomics, so it is bitwise reproducible at no
   extra cost. No token-count threshold: on the H200 (docs/PERFORMANCE.md, "Current figures",
   ``python -m magi_moe.bench --anchors``, both in one run) fused beat native 3.2-3.7x at every
   benchmark case on the anchors draw and 3.5-5.2x on the concentrated one.
"""
from __future__ import annotations

import torch

from .implementation import Implementation
from .impls import FUSED, NATIVE, NATIVE_DET, REFERENCE

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and getattr(compiler, "is_compiling", lambda: False)())


def choose_implementation(device: torch.device, dtype: torch.dtype, *,
                          deterministic: bool = False) -> Implementation:
    # native and fused declare the same backends: where one runs on ``device``, both do
    if NATIVE.skip_reason(device) or dtype not in KERNEL_DTYPES:
        return REFERENCE
    if dtype in FUSED.dtypes and ("compilable" in FUSED.capabilities or not _compiling()):
        return FUSED
    return NATIVE_DET if deterministic else NATIVE
