"""Prototype, not used by magi_moe: the one-kernel expert MLP (``expert_mlp_tma_kernel``) written
in Gluon (Triton 3.6's explicit-layout language) to control what Triton's pipeliner decides.

Same work item, same MMAs in the same order (bitwise equal on the H200), with: one mbarrier per
weight and stage, each its own allocation (the compiler's shared-memory hazard analysis then
puts 3 CTA barriers in a trip of the loop over I where the Triton kernel has 5), and the gate
and up MMAs issued together before one wait (the Triton kernel waits after each). Measured
(NOTES-perf.md, version 8): at BM=128 (H=3, S=16384) within the run-to-run variation of the
Triton kernel (-6% to +2% over three runs), 2-24% slower at BM=64. Kept as a bitwise-equal
starting point for kernels Triton's pipeliner cannot express, with its A/B bench
(``ab_gluon.py``).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)


@gluon.jit
def _swiglu7(g, u):
    # magi_moe.kernels.rounding.swiglu7 spelled out (tl.sigmoid is 1 / (1 + exp(-x))): the
    # same operations in the same order, so the same bits
    g = gl.minimum(g, 7.0)
    u = gl.minimum(gl.maximum(u, -7.0), 7.0)
    return g * (1 / (1 + gl.exp(-(1.702 * g)))) * (u + 1.0)


@gluon.jit
def _load_slice(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready_g, ready_u, ready_d,
                t, w_row, d_row, n0, TILE_BYTES: gl.constexpr):
    G_BYTES: gl.constexpr = TILE_BYTES // 3
    mbarrier.expect(ready_g.index(t), G_BYTES)
    mbarrier.expect(ready_u.index(t), G_BYTES)
    mbarrier.expect(ready_d.index(t), G_BYTES)
    tma.async_copy_global_to_shared(wg_desc, [w_row, n0], ready_g.index(t), wg_smem.index(t))
    tma.async_copy_global_to_shared(wu_desc, [w_row, n0], ready_u.index(t), wu_smem.index(t))
    tma.async_copy_global_to_shared(wd_desc, [d_row + n0, 0], ready_d.index(t), wd_smem.index(t))


@gluon.jit
def expert_mlp_gluon_kernel(
    x_ptr, wg_desc, wu_desc, wd_desc,
    gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
    block_count_ptr, rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
    HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    NJ: gl.constexpr = INTER // BLOCK_N
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    x_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                              warps_per_cta=[num_warps, 1], order=[1, 0])
    x_shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                  rank=2)
    TILE_BYTES: gl.constexpr = 2 * (2 * HEAD_DIM * BLOCK_N + BLOCK_N * HEAD_DIM)

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], x_shared)
    wg_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HEAD_DIM, BLOCK_N], wg_desc.layout)
    wu_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HEAD_DIM, BLOCK_N], wu_desc.layout)
    wd_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], wd_desc.layout)
    # one barrier per weight and stage, each its own allocation: the compiler's shared-memory
    # hazard analysis sees a copy and the next weight's byte count as independent
    ready_g = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_u = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready_d = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_g.index(i), count=1)
        mbarrier.init(ready_u.index(i), count=1)
        mbarrier.init(ready_d.index(i), count=1)

    x_rows_l: gl.constexpr = gl.SliceLayout(1, x_layout)
    x_cols_l: gl.constexpr = gl.SliceLayout(0, x_layout)
    o_rows_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    o_cols_l: gl.constexpr = gl.SliceLayout(0, acc_layout)

    num_blocks = gl.load(block_count_ptr)
    block = gl.program_id(0)
    produced = 0
    consumed = 0
    while block < num_blocks:
        bank = gl.load(block_bank_ptr + block)
        start = gl.load(block_start_ptr + block)
        end = gl.load(offsets_ptr + bank.to(gl.int64) + 1)
        w_row = bank * HEAD_DIM
        d_row = bank * INTER
        # the first STAGES-1 weight slices, while x is gathered
        for p in gl.static_range(STAGES - 1):
            _load_slice(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready_g, ready_u,
                        ready_d, produced % STAGES, w_row, d_row, p * BLOCK_N, TILE_BYTES)
            produced += 1

        rows = start + gl.arange(0, BLOCK_M, layout=x_rows_l).to(gl.int64)
        row_mask = rows < end
        tokens = gl.load(gather_ptr + rows, mask=row_mask, other=0).to(gl.int64)
        head = bank.to(gl.int64) // num_experts
        d = gl.arange(0, HEAD_DIM, layout=x_cols_l)
        x = gl.load(x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + d[None, :],
                    mask=row_mask[:, None], other=0.0)
        gl.thread_barrier()  # the previous block's MMAs are done in every warp
        x_smem.store(x)
        fence_async_shared()
        gl.thread_barrier()

        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, gu_layout)
        for j in range(NJ):
            s = consumed % STAGES
            phase = (consumed // STAGES) & 1
            mbarrier.wait(ready_g.index(s), phase)
            mbarrier.wait(ready_u.index(s), phase)
            mbarrier.wait(ready_d.index(s), phase)
            g = warpgroup_mma(x_smem, wg_smem.index(s), zero, use_acc=False, is_async=True)
            u = warpgroup_mma(x_smem, wu_smem.index(s), zero, use_acc=False, is_async=True)
            g, u, acc = warpgroup_mma_wait(num_outstanding=0, deps=(g, u, acc))
            a = gl.convert_layout(_swiglu7(g, u).to(gl.bfloat16), a_layout)
            acc = warpgroup_mma(a, wd_smem.index(s), acc, is_async=True)
            consumed += 1
            nxt = j + STAGES - 1
            if nxt < NJ:
                # the stage slice j-1 used: its MMAs are complete in every warp after this
                gl.thread_barrier()
                _load_slice(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready_g, ready_u,
                            ready_d, produced % STAGES, w_row, d_row, nxt * BLOCK_N, TILE_BYTES)
                produced += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        o_rows = start + gl.arange(0, BLOCK_M, layout=o_rows_l).to(gl.int64)
        o_mask = o_rows < end
        probs = gl.load(probs_ptr + o_rows, mask=o_mask, other=0.0)
        out = acc * probs[:, None]
        n = gl.arange(0, HEAD_DIM, layout=o_cols_l)
        gl.store(rows_ptr + o_rows[:, None] * stride_rows + n[None, :], out, mask=o_mask[:, None])
        slots = gl.load(slots_ptr + o_rows, mask=o_mask, other=0)
        gl.store(slot_route_ptr + slots, o_rows.to(gl.int32), mask=o_mask)
        block += gl.num_programs(0)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_g.index(i))
        mbarrier.invalidate(ready_u.index(i))
        mbarrier.invalidate(ready_d.index(i))
