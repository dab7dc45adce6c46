"""The precision-critical elementwise steps shared by the kernels: SwiGLU7, and rounding that
means the same thing on the GPU and under the Triton interpreter.

Found here with Triton 3.9's interpreter: ``fp32.to(tl.bfloat16)`` truncates (rounds toward
zero) instead of rounding to nearest even, with or without ``fp_downcast_rounding="rtne"``,
and turns subnormal values into wrong ones (2.39e-39 -> 7.35e-39, found by the fuzzers);
fp16 conversions are correct. A kernel that rounds an intermediate to bf16 (the SwiGLU7 output,
the down-projection operand) must therefore round by bit arithmetic when interpreted, or its
CPU results are not the GPU's maths. ``audit.selfcheck`` re-checks this on each Triton release.
"""
import triton
import triton.language as tl


@triton.jit
def swiglu7(g, u):
    """``min(g,7) * sigmoid(1.702*min(g,7)) * (clamp(u,-7,7) + 1)`` in the inputs' precision."""
    g = tl.minimum(g, 7.0)
    u = tl.minimum(tl.maximum(u, -7.0), 7.0)
    return g * tl.sigmoid(1.702 * g) * (u + 1.0)


@triton.jit
def round_to(v, dtype: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 ``v`` rounded to nearest (even) in ``dtype``; ``SOFT_BF16`` (interpreter) does the
    bf16 case by bit arithmetic, since the interpreter's own cast truncates."""
    if SOFT_BF16 and dtype == tl.bfloat16:
        return bf16_rtne_bits(v)
    else:
        return v.to(dtype)


@triton.jit
def bf16_rtne_bits(v):
    """fp32 ``v`` -> bf16, nearest even, built from the bit pattern: the interpreter's own
    fp32 -> bf16 cast is wrong even for values already exact in bf16 when they are subnormal
    (2.39e-39 became 7.35e-39), so no float conversion is involved here."""
    bits = v.to(tl.uint32, bitcast=True)
    upper = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).to(tl.uint16)
    upper = tl.where(v != v, (bits >> 16).to(tl.uint16) | 0x40, upper)  # NaN stays (quiet) NaN
    return upper.to(tl.bfloat16, bitcast=True)


@triton.jit
def bf16_rtne_as_fp32(v):
    """fp32 ``v`` -> fp32 holding the nearest-even bf16 value (NaN kept, overflow to inf)."""
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


@triton.jit
def round_operand(v, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """Round fp32 ``v`` once to ``dtype``. With ``UPCAST`` (interpreter) the result stays fp32 for
    the upcast ``tl.dot``, holding exactly the value the GPU's round-to-nearest would give."""
    if UPCAST:
        if dtype == tl.bfloat16:
            return bf16_rtne_as_fp32(v)
        else:
            return v.to(dtype).to(tl.float32)
    else:
        return v.to(dtype)
