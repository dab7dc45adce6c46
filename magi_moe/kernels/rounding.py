"""Rounding that means the same thing on the GPU and under the Triton interpreter.

Found here with Triton 3.9's interpreter: ``fp32.to(tl.bfloat16)`` truncates (rounds toward
zero) instead of rounding to nearest even, with or without ``fp_downcast_rounding="rtne"``;
fp16 conversions are correct. A kernel that rounds an intermediate to bf16 (the SwiGLU7 output,
the down-projection operand) must therefore round by bit arithmetic when interpreted, or its
CPU results are not the GPU's maths. ``audit.selfcheck`` re-checks this on each Triton release.
"""
import triton
import triton.language as tl


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
