"""How fast one Hopper MMA chain runs against its width: ``g = x @ W`` with ``x [64, 256]`` and
``W [256, N]`` (16 MMAs of ``64 x N x 16``), repeated, with ``x`` from registers (RS) or from
shared memory (SS), one or two programs per SM. Nothing is read from memory inside the loop,
so the rate is the MMA unit's (and shared memory's) alone. ``chains`` 2: a second chain on
another operand issued before the wait, as the kernel issues gate and up. The gate/up MMAs of the one-kernel
path are this chain at N = BLOCK_N (16 or 32).

    PYTHONPATH=. python scripts/proto/probe_wgmma.py        # a Hopper GPU, Triton 3.6's Gluon
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, warpgroup_mma, warpgroup_mma_wait)


@gluon.jit
def chain_kernel(x_ptr, w_ptr, out_ptr, TRIPS: gl.constexpr, N: gl.constexpr,
                 X_IN_REGISTERS: gl.constexpr, CHAINS: gl.constexpr, num_warps: gl.constexpr):
    K: gl.constexpr = 256
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, N, 16])
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, K, layout=gl.SliceLayout(0, blk))
    x = gl.load(x_ptr + rows[:, None] * K + cols[None, :])
    wr = gl.arange(0, K, layout=gl.SliceLayout(1, blk))
    wc = gl.arange(0, N, layout=gl.SliceLayout(0, blk))
    w = gl.load(w_ptr + wr[:, None] * N + wc[None, :])
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [64, K],
                                       gl.NVMMASharedLayout.get_default_for([64, K], gl.bfloat16), x)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [K, N],
                                       gl.NVMMASharedLayout.get_default_for([K, N], gl.bfloat16), w)
    # a second, different operand for the second chain (the same one would be merged away)
    w2_smem = gl.allocate_shared_memory(gl.bfloat16, [K, N],
                                        gl.NVMMASharedLayout.get_default_for([K, N], gl.bfloat16),
                                        w * 2.0)
    fence_async_shared()
    if X_IN_REGISTERS:
        a = x_smem.load(gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
    else:
        a = x_smem
    total = gl.zeros([64, N], gl.float32, mma)
    zero = gl.zeros([64, N], gl.float32, mma)
    for t in range(TRIPS):
        g = warpgroup_mma(a, w_smem, zero, use_acc=False, is_async=True)
        if CHAINS == 2:
            u = warpgroup_mma(a, w2_smem, zero, use_acc=False, is_async=True)
            g, u = warpgroup_mma_wait(num_outstanding=0, deps=(g, u))
            total += g + u
        else:
            g = warpgroup_mma_wait(num_outstanding=0, deps=(g,))
            total += g
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    ocol = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + gl.program_id(0) * 64 * N + orow[:, None] * N + ocol[None, :], total)


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(64, 256, device=dev).to(torch.bfloat16)
    trips = 2000
    print(f"{'N':>4} {'x':>4} {'chains':>6} {'prog/SM':>7} {'us':>8} {'TFLOP/s':>8} {'clk/MMA/SM':>10}")
    clock = 1.98e9
    for n in (16, 32, 64, 128):
        w = torch.randn(256, n, device=dev).to(torch.bfloat16)
        for regs in (False, True):
            for chains in (1, 2):
                for per_sm in (1, 2):
                    grid = sms * per_sm
                    out = torch.empty(grid, 64, n, device=dev)
                    def run():
                        chain_kernel[(grid,)](x, w, out, TRIPS=trips, N=n, X_IN_REGISTERS=regs,
                                              CHAINS=chains, num_warps=4)
                    run()
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(run, warmup=5, rep=50)
                    mmas = grid * trips * chains * 16
                    flops = mmas * 2 * 64 * n * 16
                    print(f"{n:>4} {'reg' if regs else 'smem':>4} {chains:>6} {per_sm:>7} "
                          f"{ms * 1e3:>8.1f} {flops / ms / 1e9:>8.0f} "
                          f"{ms * 1e-3 * clock * sms / mmas:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
