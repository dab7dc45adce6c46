"""Prototypes, not used by magi_moe: the one-kernel expert MLP (``expert_mlp_tma_kernel``) written
in Gluon (Triton 3.6's explicit-layout language) to control what Triton's pipeliner decides.
Every one is bitwise equal to the Triton kernel on the H200 (``ab_gluon.py`` checks each run);
NOTES-perf.md versions 8 and 9 have their times.

* ``expert_mlp_gluon_kernel``: the Triton kernel's work item and MMAs (below); with
  ``X_IN_REGISTERS`` the gate/up MMAs take x from registers (3-7% faster than Triton at BM=64).
* ``expert_mlp_gluon_t2_kernel``: gate/up transposed (the 64-wide I slice on the MMA's M side,
  tokens on N: 64 x BLOCK_M x 16 MMAs instead of 64 x 16 x 16) and pipelined by one slice
  (SwiGLU7 of slice t while the down MMA of slice t-1 runs); at BM=128 3-4% faster than
  Triton at S=16384.

Version 9's other forms (x loaded straight into registers; t, the transposed form without the
pipelining) measured no better than these two and were deleted; commit 579daef has them.

The first kernel in detail:
Same work item, same MMAs in the same order (bitwise equal on the H200), with: one mbarrier per
weight and stage, each its own allocation (the compiler's shared-memory hazard analysis then
puts 3 CTA barriers in a trip of the loop over I where the Triton kernel has 5), and the gate
and up MMAs issued together before one wait (the Triton kernel waits after each). Measured
(NOTES-perf.md, version 8): at BM=128 (H=3, S=16384) within the run-to-run variation of the
Triton kernel (-6% to +2% over three runs), 2-24% slower at BM=64. Kept as a bitwise-equal
starting point for kernels Triton's pipeliner cannot express, with its A/B bench
(``ab_gluon.py``).
"""
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
def _store_block_rows(acc, start, end, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                      stride_rows, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    # magi_moe.kernels.blocks.store_weighted_rows in the accumulator's own layout: p * acc in
    # fp32 into the block's route rows, and each route's CSR index into its slot
    rows_l: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
    o_rows = start + gl.arange(0, BLOCK_M, layout=rows_l).to(gl.int64)
    o_mask = o_rows < end
    probs = gl.load(probs_ptr + o_rows, mask=o_mask, other=0.0)
    out = acc * probs[:, None]
    n = gl.arange(0, HEAD_DIM, layout=cols_l)
    gl.store(rows_ptr + o_rows[:, None] * stride_rows + n[None, :], out, mask=o_mask[:, None])
    slots = gl.load(slots_ptr + o_rows, mask=o_mask, other=0)
    gl.store(slot_route_ptr + slots, o_rows.to(gl.int32), mask=o_mask)


@gluon.jit
def _gather_block_x(x_ptr, gather_ptr, start, end, bank, num_experts, stride_x,
                    x_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    # magi_moe.kernels.blocks.block_x_rows in ``x_layout``: the block's routed tokens' x rows
    # of the bank's head, zeros in padding rows
    rows = start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout)).to(gl.int64)
    row_mask = rows < end
    tokens = gl.load(gather_ptr + rows, mask=row_mask, other=0).to(gl.int64)
    head = bank.to(gl.int64) // num_experts
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, x_layout))
    return gl.load(x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + d[None, :],
                   mask=row_mask[:, None], other=0.0)


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
    STAGES: gl.constexpr, num_warps: gl.constexpr, X_IN_REGISTERS: gl.constexpr = False,
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

        x = _gather_block_x(x_ptr, gather_ptr, start, end, bank, num_experts, stride_x,
                            x_layout, BLOCK_M, HEAD_DIM)
        gl.thread_barrier()  # the previous block's MMAs are done in every warp
        x_smem.store(x)
        fence_async_shared()
        gl.thread_barrier()
        if X_IN_REGISTERS:
            # the gate/up MMAs' first operand from registers: shared memory then serves only
            # the weight tiles (x from shared memory is re-read by every 16-wide MMA)
            x_op = x_smem.load(gl.DotOperandLayout(operand_index=0, parent=gu_layout, k_width=2))
        else:
            x_op = x_smem

        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, gu_layout)
        for j in range(NJ):
            s = consumed % STAGES
            phase = (consumed // STAGES) & 1
            mbarrier.wait(ready_g.index(s), phase)
            mbarrier.wait(ready_u.index(s), phase)
            mbarrier.wait(ready_d.index(s), phase)
            g = warpgroup_mma(x_op, wg_smem.index(s), zero, use_acc=False, is_async=True)
            u = warpgroup_mma(x_op, wu_smem.index(s), zero, use_acc=False, is_async=True)
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

        _store_block_rows(acc, start, end, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                          stride_rows, BLOCK_M, HEAD_DIM)
        block += gl.num_programs(0)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready_g.index(i))
        mbarrier.invalidate(ready_u.index(i))
        mbarrier.invalidate(ready_d.index(i))


@gluon.jit
def _issue_gate_up_unit(wg_desc, wu_desc, gu_smem, gu_ready, count, unit, w_row,
                        BLOCK_N: gl.constexpr, KH: gl.constexpr, GU_SLOTS: gl.constexpr):
    # unit 4j + (0, 1, 2, 3): slice j's gate rows [0, KH), gate [KH, 2 KH), up low, up high
    slot = count % GU_SLOTS
    n0 = (unit // 4) * BLOCK_N
    kind = unit % 4
    row = w_row + (kind % 2) * KH
    mbarrier.expect(gu_ready.index(slot), KH * BLOCK_N * 2)
    if kind < 2:
        tma.async_copy_global_to_shared(wg_desc, [row, n0], gu_ready.index(slot), gu_smem.index(slot))
    else:
        tma.async_copy_global_to_shared(wu_desc, [row, n0], gu_ready.index(slot), gu_smem.index(slot))


@gluon.jit
def _gate_up_slice(gu_smem, gu_ready, x_lo, x_hi, zero, c0, GU_SLOTS: gl.constexpr):
    # g^T and u^T of one I slice from its four half-Dh units (global unit index c0 onwards)
    mbarrier.wait(gu_ready.index(c0 % GU_SLOTS), (c0 // GU_SLOTS) & 1)
    mbarrier.wait(gu_ready.index((c0 + 1) % GU_SLOTS), ((c0 + 1) // GU_SLOTS) & 1)
    g = warpgroup_mma(gu_smem.index(c0 % GU_SLOTS).permute((1, 0)), x_lo, zero,
                      use_acc=False, is_async=True)
    g = warpgroup_mma(gu_smem.index((c0 + 1) % GU_SLOTS).permute((1, 0)), x_hi, g, is_async=True)
    mbarrier.wait(gu_ready.index((c0 + 2) % GU_SLOTS), ((c0 + 2) // GU_SLOTS) & 1)
    mbarrier.wait(gu_ready.index((c0 + 3) % GU_SLOTS), ((c0 + 3) // GU_SLOTS) & 1)
    u = warpgroup_mma(gu_smem.index((c0 + 2) % GU_SLOTS).permute((1, 0)), x_lo, zero,
                      use_acc=False, is_async=True)
    u = warpgroup_mma(gu_smem.index((c0 + 3) % GU_SLOTS).permute((1, 0)), x_hi, u, is_async=True)
    return g, u


@gluon.jit
def expert_mlp_gluon_t2_kernel(
    x_ptr, wg_desc, wu_desc, wd_desc,
    gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
    block_count_ptr, rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
    HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    GU_SLOTS: gl.constexpr, num_warps: gl.constexpr,
):
    """Gate and up transposed, ``g^T = W_gate^T x^T``: the 64-wide slice of ``I`` on the MMA's M
    side, the block's tokens on its N side (a 16-wide MMA runs at half the unit's rate or
    less, NOTES-perf.md version 9). Pipelined by one slice: trip ``t`` issues slice t's
    gate/up MMAs, then slice t-1's down MMA, and waits for the gate/up ones only, so SwiGLU7
    of slice t runs on the CUDA cores while the tensor cores do the down MMA of slice t-1. The
    activation goes to shared memory as ``a^T`` (double-buffered) and the down MMA reads it
    transposed. Weight tiles: gate/up in half-Dh units ``[Dh/2, BLOCK_N]`` through a ring of
    ``GU_SLOTS``, down ``[BLOCK_N, Dh]`` double-buffered. With 8 warps and BLOCK_M 128 each
    warpgroup takes 64 tokens (the rows it holds of the output). Each product and each fp32
    sum is the plain kernel's, in the same order."""
    NJ: gl.constexpr = INTER // BLOCK_N
    UNITS: gl.constexpr = 4 * NJ
    KH: gl.constexpr = HEAD_DIM // 2
    WG: gl.constexpr = num_warps // 4
    gt_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, WG], instr_shape=[16, BLOCK_M // WG, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    x_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                              warps_per_cta=[num_warps, 1], order=[1, 0])
    x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    a_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)
    D_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * 2

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], x_shared)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_M], a_shared)
    gu_smem = gl.allocate_shared_memory(gl.bfloat16, [GU_SLOTS, KH, BLOCK_N], wg_desc.layout)
    d_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], wd_desc.layout)
    gu_ready = gl.allocate_shared_memory(gl.int64, [GU_SLOTS, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(GU_SLOTS):
        mbarrier.init(gu_ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(d_ready.index(i), count=1)

    x_lo = x_smem.slice(0, KH, dim=1).permute((1, 0))
    x_hi = x_smem.slice(KH, KH, dim=1).permute((1, 0))

    num_blocks = gl.load(block_count_ptr)
    block = gl.program_id(0)
    gu_count = 0
    d_count = 0
    while block < num_blocks:
        bank = gl.load(block_bank_ptr + block)
        start = gl.load(block_start_ptr + block)
        end = gl.load(offsets_ptr + bank.to(gl.int64) + 1)
        w_row = bank * HEAD_DIM
        d_row = bank * INTER
        gu_base = gu_count
        d_base = d_count
        gl.thread_barrier()
        for p in gl.static_range(GU_SLOTS):
            _issue_gate_up_unit(wg_desc, wu_desc, gu_smem, gu_ready, gu_count, p, w_row,
                                BLOCK_N, KH, GU_SLOTS)
            gu_count += 1
        for jd in gl.static_range(2):
            slot = d_count % 2
            mbarrier.expect(d_ready.index(slot), D_BYTES)
            tma.async_copy_global_to_shared(wd_desc, [d_row + jd * BLOCK_N, 0],
                                            d_ready.index(slot), d_smem.index(slot))
            d_count += 1

        x = _gather_block_x(x_ptr, gather_ptr, start, end, bank, num_experts, stride_x,
                            x_layout, BLOCK_M, HEAD_DIM)
        x_smem.store(x)
        fence_async_shared()
        gl.thread_barrier()

        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, gt_layout)
        # slice 0: nothing to overlap yet
        g, u = _gate_up_slice(gu_smem, gu_ready, x_lo, x_hi, zero, gu_base, GU_SLOTS)
        g, u = warpgroup_mma_wait(num_outstanding=0, deps=(g, u))
        gl.thread_barrier()
        limit = gu_base + gl.minimum(4 + GU_SLOTS, UNITS)
        while gu_count < limit:
            _issue_gate_up_unit(wg_desc, wu_desc, gu_smem, gu_ready, gu_count,
                                gu_count - gu_base, w_row, BLOCK_N, KH, GU_SLOTS)
            gu_count += 1
        a_smem.index(0).store(_swiglu7(g, u).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        for t in range(1, NJ):
            g, u = _gate_up_slice(gu_smem, gu_ready, x_lo, x_hi, zero, gu_base + 4 * t, GU_SLOTS)
            cd = d_base + t - 1
            mbarrier.wait(d_ready.index(cd % 2), (cd // 2) & 1)
            acc = warpgroup_mma(a_smem.index((t - 1) % 2).permute((1, 0)), d_smem.index(cd % 2),
                                acc, is_async=True)
            # gate/up of slice t done (and the down MMA of t-2); the down of t-1 may run on
            g, u = warpgroup_mma_wait(num_outstanding=1, deps=(g, u))
            gl.thread_barrier()  # every warp is past that wait: slice t's units and d(t-2) free
            limit = gu_base + gl.minimum(4 * t + 4 + GU_SLOTS, UNITS)
            while gu_count < limit:
                _issue_gate_up_unit(wg_desc, wu_desc, gu_smem, gu_ready, gu_count,
                                    gu_count - gu_base, w_row, BLOCK_N, KH, GU_SLOTS)
                gu_count += 1
            if t >= 2:
                slot = d_count % 2
                mbarrier.expect(d_ready.index(slot), D_BYTES)
                tma.async_copy_global_to_shared(wd_desc, [d_row + t * BLOCK_N, 0],
                                                d_ready.index(slot), d_smem.index(slot))
                d_count += 1
            a_smem.index(t % 2).store(_swiglu7(g, u).to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
        cd = d_base + NJ - 1
        mbarrier.wait(d_ready.index(cd % 2), (cd // 2) & 1)
        acc = warpgroup_mma(a_smem.index((NJ - 1) % 2).permute((1, 0)), d_smem.index(cd % 2),
                            acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        _store_block_rows(acc, start, end, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                          stride_rows, BLOCK_M, HEAD_DIM)
        block += gl.num_programs(0)

    for i in gl.static_range(GU_SLOTS):
        mbarrier.invalidate(gu_ready.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(d_ready.index(i))
