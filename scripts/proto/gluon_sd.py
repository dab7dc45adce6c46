"""Prototype, not used by magi_moe: the one-kernel expert MLP with the down projection's output
split across two warpgroups ("split-D"; NOTES-perf.md version 12).

Why (versions 8 and 9): at BLOCK_M=64 one warpgroup holds the whole fp32 ``[64, Dh=256]``
output accumulator (128 registers a thread), which leaves room only for 16-wide gate/up
slices; a 16-wide MMA with x from shared memory runs at about 384 TFLOP/s, half the unit's
rate, and the gate/up MMAs are 32 of the 33 MMAs a trip. Here a program has two 4-warp
partitions that share one 64-row block and one weight stream:

* G (the default partition; it also issues the TMA fills): the gate MMA of a BLOCK_N-wide
  slice, SwiGLU7 of it with U's up slice (read from shared memory), the activation rounded to
  bf16 once and written to shared memory for U, and the down MMA into output columns
  ``[0, Dh/2)``;
* U: the up MMA of the slice, written (fp32) to shared memory for G, and the down MMA into
  output columns ``[Dh/2, Dh)`` from the activation G wrote.

Each accumulator is ``[64, Dh/2]`` (64 registers a thread), so 32-wide slices fit; every
output element is still ``sum_j a_j W_down[j]`` over 16-wide K steps in the order of ``j``, and
the gate/up sums are the same MMAs over Dh, so the bits are the Triton kernel's.

Measured on the H200 (NOTES-perf.md version 12): bitwise equal in every ANCHORS case, and
5-29% slower than the Triton kernel (S=4096: 0.621 against 0.545 ms): each trip is one chain
of MMAs, exchange and SwiGLU7, and one 8-warp program per SM has nobody to overlap it with
(the Triton kernel runs two 4-warp programs). ``U_SWIZZLE`` False: the fp32 exchange tile
without the XOR swizzle (2-7% slower: bank conflicts). Pipelining by one slice with the
next gate/up accumulator in flight across the loop made ptxas serialise every wgmma (C7514).

``expert_mlp_gluon_sdi_kernel`` (below) drops the fp32 exchange: the partitions take
alternate slices and trade only activations. Bitwise equal too, and slower still (S=4096:
0.707 against 0.542 ms for Triton, 0.608 for split-D in the same run).

Barriers: ``ready``/``empty`` per ring slot (``empty`` counts one arrival per partition, after
its MMAs that read the slot are complete); ``x_ready``/``x_free`` for the block's x tile;
``u_ready``/``u_free`` and ``a_ready``/``a_free`` per exchange buffer (two of each, used by
slices alternately).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from gluon_mlp import _gather_block_x, _swiglu7


@gluon.jit
def _store_half(acc, start, end, col0, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                stride_rows, WRITE_SLOTS: gl.constexpr, BLOCK_M: gl.constexpr,
                HALF: gl.constexpr):
    # blocks.store_weighted_rows for output columns [col0, col0 + HALF)
    rows_l: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
    o_rows = start + gl.arange(0, BLOCK_M, layout=rows_l).to(gl.int64)
    o_mask = o_rows < end
    probs = gl.load(probs_ptr + o_rows, mask=o_mask, other=0.0)
    out = acc * probs[:, None]
    n = col0 + gl.arange(0, HALF, layout=cols_l)
    gl.store(rows_ptr + o_rows[:, None] * stride_rows + n[None, :], out, mask=o_mask[:, None])
    if WRITE_SLOTS:
        slots = gl.load(slots_ptr + o_rows, mask=o_mask, other=0)
        gl.store(slot_route_ptr + slots, o_rows.to(gl.int32), mask=o_mask)


@gluon.jit
def _fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd0_smem, wd1_smem, ready, empty, f,
          bank, j, HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr):
    """Fill ``f`` of the ring: slice ``j`` of ``bank``'s weights, once both partitions released
    the slot's previous fill."""
    s = f % STAGES
    HALF: gl.constexpr = HEAD_DIM // 2
    mbarrier.wait(empty.index(s), ((f // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), 2 * 3 * HEAD_DIM * BLOCK_N)
    tma.async_copy_global_to_shared(wg_desc, [bank * HEAD_DIM, j * BLOCK_N], ready.index(s),
                                    wg_smem.index(s))
    tma.async_copy_global_to_shared(wu_desc, [bank * HEAD_DIM, j * BLOCK_N], ready.index(s),
                                    wu_smem.index(s))
    tma.async_copy_global_to_shared(wd_desc, [bank * INTER + j * BLOCK_N, 0], ready.index(s),
                                    wd0_smem.index(s))
    tma.async_copy_global_to_shared(wd_desc, [bank * INTER + j * BLOCK_N, HALF], ready.index(s),
                                    wd1_smem.index(s))


@gluon.jit
def _partition_g(x_ptr, wg_desc, wu_desc, wd_desc, x_smem, wg_smem, wu_smem, wd0_smem, wd1_smem,
                 u_smem, a_smem, ready, empty, x_ready, x_free, u_ready, u_free, a_ready, a_free,
                 gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
                 block_count_ptr, rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
                 HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    NJ: gl.constexpr = INTER // BLOCK_N
    HALF: gl.constexpr = HEAD_DIM // 2
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    x_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                              warps_per_cta=[4, 1], order=[1, 0])
    num_blocks = gl.load(block_count_ptr)
    block = gl.program_id(0)
    produced = 0
    consumed = 0
    blocks_done = 0
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, gu_layout)
    while block < num_blocks:
        bank = gl.load(block_bank_ptr + block)
        start = gl.load(block_start_ptr + block)
        end = gl.load(offsets_ptr + bank.to(gl.int64) + 1)
        for p in gl.static_range(STAGES - 1):
            _fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd0_smem, wd1_smem, ready, empty,
                  produced, bank, p, HEAD_DIM, INTER, BLOCK_N, STAGES)
            produced += 1
        x = _gather_block_x(x_ptr, gather_ptr, start, end, bank, num_experts, stride_x,
                            x_layout, BLOCK_M, HEAD_DIM)
        mbarrier.wait(x_free, (blocks_done & 1) ^ 1)  # U's up MMAs of the last block are done
        x_smem.store(x)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(x_ready)

        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout))
        for j in range(NJ):
            s = consumed % STAGES
            mbarrier.wait(ready.index(s), (consumed // STAGES) & 1)
            g = warpgroup_mma(x_smem, wg_smem.index(s), zero, use_acc=False, is_async=True)
            g, acc = warpgroup_mma_wait(num_outstanding=0, deps=(g, acc))
            # the previous slice's down MMA is complete: its slot is free for G
            mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES), pred=j > 0)
            b = consumed % 2
            phase = (consumed // 2) & 1
            mbarrier.wait(u_ready.index(b), phase)
            u = u_smem.index(b).load(gu_layout)
            gl.thread_barrier()
            mbarrier.arrive(u_free.index(b))
            a = _swiglu7(g, u).to(gl.bfloat16)
            mbarrier.wait(a_free.index(b), phase ^ 1)  # U's down MMA two slices back is done
            a_smem.index(b).store(a)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(a_ready.index(b))
            acc = warpgroup_mma(gl.convert_layout(a, a_layout), wd0_smem.index(s), acc,
                                is_async=True)
            consumed += 1
            if j + STAGES - 1 < NJ:
                _fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd0_smem, wd1_smem, ready,
                      empty, produced, bank, j + STAGES - 1, HEAD_DIM, INTER, BLOCK_N, STAGES)
                produced += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES))
        _store_half(acc, start, end, 0, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                    stride_rows, True, BLOCK_M, HALF)
        blocks_done += 1
        block += gl.num_programs(0)


@gluon.jit
def _partition_u(x_smem, wu_smem, wd1_smem, u_smem, a_smem, ready, empty, x_ready, x_free,
                 u_ready, u_free, a_ready, a_free,
                 probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
                 block_count_ptr, rows_ptr, slot_route_ptr, stride_rows,
                 HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    NJ: gl.constexpr = INTER // BLOCK_N
    HALF: gl.constexpr = HEAD_DIM // 2
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    num_blocks = gl.load(block_count_ptr)
    block = gl.program_id(0)
    consumed = 0
    blocks_done = 0
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, gu_layout)
    while block < num_blocks:
        bank = gl.load(block_bank_ptr + block)
        start = gl.load(block_start_ptr + block)
        end = gl.load(offsets_ptr + bank.to(gl.int64) + 1)
        mbarrier.wait(x_ready, blocks_done & 1)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout))
        for j in range(NJ):
            s = consumed % STAGES
            mbarrier.wait(ready.index(s), (consumed // STAGES) & 1)
            u = warpgroup_mma(x_smem, wu_smem.index(s), zero, use_acc=False, is_async=True)
            u, acc = warpgroup_mma_wait(num_outstanding=0, deps=(u, acc))
            # the previous slice's down MMA is complete: its slot and activation buffer are free
            mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES), pred=j > 0)
            mbarrier.arrive(a_free.index((consumed + 1) % 2), pred=j > 0)
            if j == NJ - 1:
                mbarrier.arrive(x_free)  # the block's last up MMA is done
            b = consumed % 2
            phase = (consumed // 2) & 1
            mbarrier.wait(u_free.index(b), phase ^ 1)
            u_smem.index(b).store(u)
            gl.thread_barrier()
            mbarrier.arrive(u_ready.index(b))
            mbarrier.wait(a_ready.index(b), phase)
            acc = warpgroup_mma(a_smem.index(b), wd1_smem.index(s), acc, is_async=True)
            consumed += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((consumed + STAGES - 1) % STAGES))
        mbarrier.arrive(a_free.index((consumed + 1) % 2))
        _store_half(acc, start, end, HALF, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                    stride_rows, False, BLOCK_M, HALF)
        blocks_done += 1
        block += gl.num_programs(0)


@gluon.jit
def expert_mlp_gluon_sd_kernel(
    x_ptr, wg_desc, wu_desc, wd_desc,
    gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
    block_count_ptr, rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
    HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, SPLIT_D: gl.constexpr = True,
    U_REGS: gl.constexpr = 256, U_SWIZZLE: gl.constexpr = True,
):
    """``wd_desc``: ``W_down`` with ``[BLOCK_N, Dh/2]`` boxes (each slot gets both halves)."""
    gl.static_assert(BLOCK_M == 64, "one 64-row block per program, shared by the partitions")
    gl.static_assert(num_warps == 4, "G is the default partition's 4 warps, U 4 more")
    HALF: gl.constexpr = HEAD_DIM // 2
    x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    a_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    # fp32 exchange tile: rows XOR-swizzled in 8-byte units (each warp of the accumulator
    # layout writes 8 rows of the same columns at once)
    if U_SWIZZLE:
        u_shared: gl.constexpr = gl.SwizzledSharedLayout(vec=2, per_phase=1,
                                                         max_phase=BLOCK_N // 2, order=[1, 0])
    else:
        u_shared: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                         order=[1, 0])
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], x_shared)
    wg_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HEAD_DIM, BLOCK_N], wg_desc.layout)
    wu_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HEAD_DIM, BLOCK_N], wu_desc.layout)
    wd0_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HALF], wd_desc.layout)
    wd1_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HALF], wd_desc.layout)
    u_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, BLOCK_N], u_shared)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_N], a_shared)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    x_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    u_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    u_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    a_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(x_ready, count=1)
    mbarrier.init(x_free, count=1)
    for i in gl.static_range(2):
        mbarrier.init(u_ready.index(i), count=1)
        mbarrier.init(u_free.index(i), count=1)
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_free.index(i), count=1)

    # the arguments written out (constexprs in a tuple variable would turn into tensors)
    gl.warp_specialize([
        (_partition_g, (x_ptr, wg_desc, wu_desc, wd_desc, x_smem, wg_smem, wu_smem, wd0_smem,
                        wd1_smem, u_smem, a_smem, ready, empty, x_ready, x_free, u_ready, u_free,
                        a_ready, a_free, gather_ptr, probs_ptr, slots_ptr, offsets_ptr,
                        block_bank_ptr, block_start_ptr, block_count_ptr, rows_ptr,
                        slot_route_ptr, stride_x, stride_rows, num_experts,
                        HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES)),
        (_partition_u, (x_smem, wu_smem, wd1_smem, u_smem, a_smem, ready, empty, x_ready,
                        x_free, u_ready, u_free, a_ready, a_free, probs_ptr, slots_ptr,
                        offsets_ptr, block_bank_ptr, block_start_ptr, block_count_ptr, rows_ptr,
                        slot_route_ptr, stride_rows, HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES)),
    ], [4], [U_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


# ---------------------------------------------------------------------------------------------
# split-D with interleaved slices: no fp32 exchange
# ---------------------------------------------------------------------------------------------
@gluon.jit
def _sdi_fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd0_smem, wd1_smem, gu_ready,
              gu_empty, d_ready, d_empty, f, bank, j, HEAD_DIM: gl.constexpr,
              INTER: gl.constexpr, BLOCK_N: gl.constexpr, GU_SLOTS: gl.constexpr,
              D_SLOTS: gl.constexpr):
    """Fill ``f`` (the program's global slice count): slice ``j`` of ``bank``'s gate/up tiles
    into the gate/up ring, its down tiles (both column halves) into the down ring."""
    HALF: gl.constexpr = HEAD_DIM // 2
    g = f % GU_SLOTS
    mbarrier.wait(gu_empty.index(g), ((f // GU_SLOTS) & 1) ^ 1)
    mbarrier.expect(gu_ready.index(g), 2 * 2 * HEAD_DIM * BLOCK_N)
    tma.async_copy_global_to_shared(wg_desc, [bank * HEAD_DIM, j * BLOCK_N], gu_ready.index(g),
                                    wg_smem.index(g))
    tma.async_copy_global_to_shared(wu_desc, [bank * HEAD_DIM, j * BLOCK_N], gu_ready.index(g),
                                    wu_smem.index(g))
    d = f % D_SLOTS
    mbarrier.wait(d_empty.index(d), ((f // D_SLOTS) & 1) ^ 1)
    mbarrier.expect(d_ready.index(d), 2 * HEAD_DIM * BLOCK_N)
    tma.async_copy_global_to_shared(wd_desc, [bank * INTER + j * BLOCK_N, 0], d_ready.index(d),
                                    wd0_smem.index(d))
    tma.async_copy_global_to_shared(wd_desc, [bank * INTER + j * BLOCK_N, HALF], d_ready.index(d),
                                    wd1_smem.index(d))


@gluon.jit
def _sdi_partition(WHICH: gl.constexpr, x_ptr, wg_desc, wu_desc, wd_desc, x_smem, wg_smem,
                   wu_smem, wd0_smem, wd1_smem, a_smem, gu_ready, gu_empty, d_ready, d_empty,
                   x_ready, x_free, a_ready, a_free,
                   gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr,
                   block_start_ptr, block_count_ptr, rows_ptr, slot_route_ptr, stride_x,
                   stride_rows, num_experts,
                   HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, GU_SLOTS: gl.constexpr, D_SLOTS: gl.constexpr,
                   A_SLOTS: gl.constexpr):
    """Partition ``WHICH`` computes the gate/up MMAs and SwiGLU7 of the slices ``j`` with
    ``j % 2 == WHICH``, writes their activation to shared memory, and multiplies every slice's
    activation (its own and the other partition's, in the order of ``j``) into output columns
    ``[WHICH * Dh/2, (WHICH + 1) * Dh/2)``. Partition 0 also gathers x and issues the fills."""
    NJ: gl.constexpr = INTER // BLOCK_N
    HALF: gl.constexpr = HEAD_DIM // 2
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
    x_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                              warps_per_cta=[4, 1], order=[1, 0])
    if WHICH == 0:
        wd_half = wd0_smem
    else:
        wd_half = wd1_smem
    num_blocks = gl.load(block_count_ptr)
    block = gl.program_id(0)
    base = 0  # slices of earlier blocks: fill, ring and activation counters are global
    produced = 0
    blocks_done = 0
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, gu_layout)
    while block < num_blocks:
        bank = gl.load(block_bank_ptr + block)
        start = gl.load(block_start_ptr + block)
        end = gl.load(offsets_ptr + bank.to(gl.int64) + 1)
        if WHICH == 0:
            for p in gl.static_range(2):
                _sdi_fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd0_smem, wd1_smem,
                          gu_ready, gu_empty, d_ready, d_empty, produced, bank, p, HEAD_DIM,
                          INTER, BLOCK_N, GU_SLOTS, D_SLOTS)
                produced += 1
            x = _gather_block_x(x_ptr, gather_ptr, start, end, bank, num_experts, stride_x,
                                x_layout, BLOCK_M, HEAD_DIM)
            mbarrier.wait(x_free, (blocks_done & 1) ^ 1)  # both partitions' last block is done
            x_smem.store(x)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(x_ready)
        else:
            mbarrier.wait(x_ready, blocks_done & 1)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HALF], gl.float32, acc_layout))
        for jj in range(NJ // 2):
            mine = base + 2 * jj + WHICH  # global count of this partition's slice
            gs = mine % GU_SLOTS
            mbarrier.wait(gu_ready.index(gs), (mine // GU_SLOTS) & 1)
            g = warpgroup_mma(x_smem, wg_smem.index(gs), zero, use_acc=False, is_async=True)
            u = warpgroup_mma(x_smem, wu_smem.index(gs), zero, use_acc=False, is_async=True)
            g, u, acc = warpgroup_mma_wait(num_outstanding=0, deps=(g, u, acc))
            mbarrier.arrive(gu_empty.index(gs))
            if jj == NJ // 2 - 1:
                mbarrier.arrive(x_free)  # this partition's last MMA reading x is done
            # the down MMAs of the previous two slices are done: their tiles and activations
            # are free as far as this partition goes
            for t in gl.static_range(2):
                prev = base + 2 * jj - 2 + t
                mbarrier.arrive(d_empty.index(prev % D_SLOTS), pred=jj > 0)
                mbarrier.arrive(a_free.index(prev % A_SLOTS), pred=jj > 0)
            a = _swiglu7(g, u).to(gl.bfloat16)
            mbarrier.wait(a_free.index(mine % A_SLOTS), ((mine // A_SLOTS) & 1) ^ 1)
            a_smem.index(mine % A_SLOTS).store(a)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(a_ready.index(mine % A_SLOTS))
            for t in gl.static_range(2):  # slices 2 jj and 2 jj + 1, in order
                c = base + 2 * jj + t
                mbarrier.wait(a_ready.index(c % A_SLOTS), (c // A_SLOTS) & 1)
                mbarrier.wait(d_ready.index(c % D_SLOTS), (c // D_SLOTS) & 1)
                acc = warpgroup_mma(a_smem.index(c % A_SLOTS), wd_half.index(c % D_SLOTS), acc,
                                    is_async=True)
            if WHICH == 0:
                for t in gl.static_range(2):
                    if 2 * jj + 2 + t < NJ:
                        _sdi_fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd0_smem,
                                  wd1_smem, gu_ready, gu_empty, d_ready, d_empty, produced,
                                  bank, 2 * jj + 2 + t, HEAD_DIM, INTER, BLOCK_N, GU_SLOTS,
                                  D_SLOTS)
                        produced += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for t in gl.static_range(2):
            last = base + NJ - 2 + t
            mbarrier.arrive(d_empty.index(last % D_SLOTS))
            mbarrier.arrive(a_free.index(last % A_SLOTS))
        _store_half(acc, start, end, WHICH * HALF, probs_ptr, slots_ptr, rows_ptr,
                    slot_route_ptr, stride_rows, WHICH == 0, BLOCK_M, HALF)
        base += NJ
        blocks_done += 1
        block += gl.num_programs(0)


@gluon.jit
def expert_mlp_gluon_sdi_kernel(
    x_ptr, wg_desc, wu_desc, wd_desc,
    gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
    block_count_ptr, rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
    HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, SPLIT_D: gl.constexpr = True,
    U_REGS: gl.constexpr = 256, GU_SLOTS: gl.constexpr = 3, D_SLOTS: gl.constexpr = 4,
    A_SLOTS: gl.constexpr = 4,
):
    """Split-D without the fp32 exchange: the partitions take alternate slices of I (gate/up
    and SwiGLU7 of their own, the down MMA of every slice into their half of the columns), so
    each computes while the other does. ``STAGES`` is unused (the rings are ``GU_SLOTS`` and
    ``D_SLOTS``; the down ring is deeper because both partitions read it)."""
    gl.static_assert(BLOCK_M == 64, "one 64-row block per program, shared by the partitions")
    gl.static_assert(num_warps == 4, "partition 0 is the default partition's 4 warps")
    gl.static_assert((INTER // BLOCK_N) % 2 == 0, "an even number of slices")
    HALF: gl.constexpr = HEAD_DIM // 2
    x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    a_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], x_shared)
    wg_smem = gl.allocate_shared_memory(gl.bfloat16, [GU_SLOTS, HEAD_DIM, BLOCK_N], wg_desc.layout)
    wu_smem = gl.allocate_shared_memory(gl.bfloat16, [GU_SLOTS, HEAD_DIM, BLOCK_N], wu_desc.layout)
    wd0_smem = gl.allocate_shared_memory(gl.bfloat16, [D_SLOTS, BLOCK_N, HALF], wd_desc.layout)
    wd1_smem = gl.allocate_shared_memory(gl.bfloat16, [D_SLOTS, BLOCK_N, HALF], wd_desc.layout)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [A_SLOTS, BLOCK_M, BLOCK_N], a_shared)
    gu_ready = gl.allocate_shared_memory(gl.int64, [GU_SLOTS, 1], mbarrier.MBarrierLayout())
    gu_empty = gl.allocate_shared_memory(gl.int64, [GU_SLOTS, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [D_SLOTS, 1], mbarrier.MBarrierLayout())
    d_empty = gl.allocate_shared_memory(gl.int64, [D_SLOTS, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [A_SLOTS, 1], mbarrier.MBarrierLayout())
    a_free = gl.allocate_shared_memory(gl.int64, [A_SLOTS, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    x_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(GU_SLOTS):
        mbarrier.init(gu_ready.index(i), count=1)
        mbarrier.init(gu_empty.index(i), count=1)  # only the slice's owner reads gate/up
    for i in gl.static_range(D_SLOTS):
        mbarrier.init(d_ready.index(i), count=1)
        mbarrier.init(d_empty.index(i), count=2)
    for i in gl.static_range(A_SLOTS):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_free.index(i), count=2)
    mbarrier.init(x_ready, count=1)
    mbarrier.init(x_free, count=2)

    gl.warp_specialize([
        (_sdi_partition, (0, x_ptr, wg_desc, wu_desc, wd_desc, x_smem, wg_smem, wu_smem,
                          wd0_smem, wd1_smem, a_smem, gu_ready, gu_empty, d_ready, d_empty,
                          x_ready, x_free, a_ready, a_free, gather_ptr, probs_ptr, slots_ptr,
                          offsets_ptr, block_bank_ptr, block_start_ptr, block_count_ptr,
                          rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
                          HEAD_DIM, INTER, BLOCK_M, BLOCK_N, GU_SLOTS, D_SLOTS, A_SLOTS)),
        (_sdi_partition, (1, x_ptr, wg_desc, wu_desc, wd_desc, x_smem, wg_smem, wu_smem,
                          wd0_smem, wd1_smem, a_smem, gu_ready, gu_empty, d_ready, d_empty,
                          x_ready, x_free, a_ready, a_free, gather_ptr, probs_ptr, slots_ptr,
                          offsets_ptr, block_bank_ptr, block_start_ptr, block_count_ptr,
                          rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
                          HEAD_DIM, INTER, BLOCK_M, BLOCK_N, GU_SLOTS, D_SLOTS, A_SLOTS)),
    ], [4], [U_REGS])
