"""magi-moe's own implementations, registered by name."""
from __future__ import annotations

import torch

from .reference import expert_reference
from .registry import Implementation, register
from .validation import check_out

ALL_BACKENDS = ("cpu", "interpret", "cuda")
TRITON_BACKENDS = ("interpret", "cuda")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _reference(x, table, weights, config, *, out):
    check_out(out, x, torch.float64)
    return out.copy_(expert_reference(x, table, weights, config, precision="float64"))


def _torch_bf16(x, table, weights, config, *, out):
    check_out(out, x)
    return out.copy_(expert_reference(x, table, weights, config, precision="bf16"))


def _native(deterministic: bool):
    def forward(x, table, weights, config, *, out):
        from .kernels.native import native_forward  # Triton imported only when used
        return native_forward(x, table, weights, config, deterministic=deterministic, out=out)
    return forward


def _fused(x, table, weights, config, *, out):
    from .kernels.fused import fused_forward  # Triton imported only when used
    return fused_forward(x, table, weights, config, out=out)


register(Implementation(
    "reference", _reference, ALL_BACKENDS, "float64", dtypes=FLOAT_DTYPES,
    capabilities={"int64_offsets"},
    description="float64 oracle: per-expert loop, no intermediate rounding"))
register(Implementation(
    "torch-bf16", _torch_bf16, ALL_BACKENDS, "bf16-plain",
    capabilities={"int64_offsets"},
    description="plain PyTorch per-expert loop at working precision (FlashAttention-style baseline)"))
register(Implementation(
    "native", _native(False), TRITON_BACKENDS, "bf16-fp32acc-atomic", dtypes=FLOAT_DTYPES,
    capabilities={"int64_offsets"},
    description="Triton gather/expert/scatter kernel, fp32 atomics into an fp32 accumulator"))
register(Implementation(
    "native-det", _native(True), TRITON_BACKENDS, "bf16-fp32acc", dtypes=FLOAT_DTYPES,
    capabilities={"int64_offsets", "deterministic"},
    description="the native kernel storing per-route rows, reduced over top-k in a fixed order"))
register(Implementation(
    "fused", _fused, TRITON_BACKENDS, "bf16-fp32acc", dtypes=(torch.bfloat16, torch.float16),
    capabilities={"deterministic", "int64_offsets", "weight_cache", "no_host_sync"},
    description="fused BF16 path: grouped gate/up + down GEMMs over padded per-expert blocks, "
                "fp32 top-k sum without atomics, device-built block schedule"))
