"""magi-moe's own implementations, declared as plain data (:data:`BUILTINS`); the registry
imports them. Triton is imported only when a kernel runs."""
from __future__ import annotations

import torch

from .backends import BACKENDS
from .implementation import Implementation, RowLauncher
from .reference import expert_reference
from .validation import check_out

# Plain PyTorch runs the same code on "cpu" and "interpret" (the interpreter runs Triton kernels):
# declared on both, every conformance row of reference and torch-bf16 ran twice on the CPU.
TORCH_BACKENDS = tuple(b.name for b in BACKENDS.values() if b.runs_plain_pytorch)
TRITON_BACKENDS = tuple(b.name for b in BACKENDS.values() if b.runs_triton)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _reference(x, table, weights, config, *, out):
    check_out(out, x, torch.float64)
    return out.copy_(expert_reference(x, table, weights, config, precision="float64"))


def _torch_bf16(x, table, weights, config, *, out):
    check_out(out, x)
    return out.copy_(expert_reference(x, table, weights, config, precision="bf16"))


def _native(deterministic: bool):
    def forward(x, table, weights, config, *, out):
        from .kernels.native import native_forward
        return native_forward(x, table, weights, config, deterministic=deterministic, out=out)
    return forward


def _fused(x, table, weights, config, *, out):
    from .kernels.fused import fused_forward
    return fused_forward(x, table, weights, config, out=out)


def _fused_layer(x, gate, bias, weights, config):
    from .kernels.fused_op import layer_forward
    return layer_forward(x, gate, bias, weights, config)


def _fused_router(x, gate, bias, config):
    """The fused layer's own router (bitwise the routes and probabilities ``fused-layer`` uses),
    so expert parallelism and forced-implementation layers route exactly as the fused layer."""
    from .kernels.router_choices import fused_routes

    return fused_routes(x, gate, bias, config)


def _pack(weights):
    from .packed_weights import pack_expert_weights
    return pack_expert_weights(weights)


REFERENCE = Implementation(
    "reference", _reference, TORCH_BACKENDS, "float64", dtypes=FLOAT_DTYPES,
    capabilities={"int64_offsets", "strided_weights", "input_checks"},
    description="float64 oracle: per-expert loop, no intermediate rounding")
TORCH_BF16 = Implementation(
    "torch-bf16", _torch_bf16, TORCH_BACKENDS, "bf16-plain",
    capabilities={"int64_offsets", "strided_weights", "input_checks"},
    description="plain PyTorch per-expert loop at working precision (FlashAttention-style baseline)")
NATIVE = Implementation(
    "native", _native(False), TRITON_BACKENDS, "bf16-fp32acc-atomic", dtypes=FLOAT_DTYPES,
    capabilities={"int64_offsets", "input_checks"},
    launcher=RowLauncher("magi_moe.kernels.native:launch_native", "accumulate"),
    description="Triton gather/expert/scatter kernel, fp32 atomics into an fp32 accumulator")
NATIVE_DET = Implementation(
    "native-det", _native(True), TRITON_BACKENDS, "bf16-fp32acc", dtypes=FLOAT_DTYPES,
    capabilities={"int64_offsets", "deterministic", "input_checks"},
    launcher=RowLauncher("magi_moe.kernels.native:launch_native", "route_rows"),
    description="the native kernel storing per-route rows, reduced over top-k in a fixed order")
FUSED = Implementation(
    "fused", _fused, TRITON_BACKENDS, "bf16-fp32acc", dtypes=(torch.bfloat16, torch.float16),
    capabilities={"deterministic", "int64_offsets", "weight_cache", "no_host_sync",
                  "strided_weights", "input_checks", "compilable"},
    layer_forward=_fused_layer,
    launcher=RowLauncher("magi_moe.kernels.row_launcher:launch_fused_rows", "route_rows"),
    prepare_weights=_pack,
    router=_fused_router,
    description="fused BF16 path: grouped gate/up + down GEMMs over padded per-expert blocks, "
                "fp32 top-k sum without atomics, device-built block schedule")

BUILTINS: tuple[Implementation, ...] = (REFERENCE, TORCH_BF16, NATIVE, NATIVE_DET, FUSED)
BASELINE = TORCH_BF16  # the FlashAttention-style "plain PyTorch at working precision" baseline
