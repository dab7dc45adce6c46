"""Tiny Triton kernels for the backend self-check (:mod:`audit.selfcheck`).

Import only after choosing the backend: the interpreter flag is read when kernels are decorated.
Each kernel exercises one operation the native and fused kernels rely on.
"""
from __future__ import annotations

import triton
import triton.language as tl

from magi_moe.kernels.rounding import round_to, swiglu7


@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr,
               M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
               UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``c[M, N] = a[M, K] @ b[K, N]`` (row-major) in fp32, operands upcast first if UPCAST."""
    m = tl.arange(0, M)
    n = tl.arange(0, N)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    c = tl.dot(a, b, input_precision=DOT_PRECISION)
    tl.store(c_ptr + m[:, None] * N + n[None, :], c)


@triton.jit
def load_store_kernel(src_bf16_ptr, src_f32_ptr, copy_ptr, upcast_ptr, downcast_ptr, rounded_ptr,
                      n, BLOCK: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Masked bf16 copy, bf16 -> fp32 upcast, fp32 -> bf16 by the backend's cast and by the
    kernels' own ``round_to``; ``n`` need not divide BLOCK."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_bf16_ptr + offs, mask=mask, other=0.0)
    tl.store(copy_ptr + offs, x, mask=mask)
    tl.store(upcast_ptr + offs, x.to(tl.float32), mask=mask)
    y = tl.load(src_f32_ptr + offs, mask=mask, other=0.0)
    tl.store(downcast_ptr + offs, y.to(downcast_ptr.dtype.element_ty), mask=mask)
    tl.store(rounded_ptr + offs, round_to(y, rounded_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit
def atomic_add_kernel(values_ptr, index_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[index[i]] += values[i]`` with fp32 atomics; many programs hit the same slots."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(values_ptr + offs, mask=mask, other=0.0)
    idx = tl.load(index_ptr + offs, mask=mask, other=0).to(tl.int64)
    tl.atomic_add(out_ptr + idx, v, mask=mask)


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """The native kernel's own fp32 SwiGLU7, elementwise."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, swiglu7(g, u), mask=mask)


def launch_dot(a, b, c, *, upcast: bool, dot_precision: str) -> None:
    M, K = a.shape
    N = b.shape[1]
    dot_kernel[(1,)](a, b, c, M=M, N=N, K=K, UPCAST=upcast, DOT_PRECISION=dot_precision)


def launch_elementwise(kernel, *args, n: int, block: int = 64, **meta) -> None:
    kernel[(triton.cdiv(n, block),)](*args, n, BLOCK=block, **meta)
