"""Prototype, not used by magi_moe: the one-kernel expert MLP warp-specialised, one weight stream
feeding two independent 64-row consumers (NOTES-perf.md version 10).

Why (version 9): at BM=64 every 64-row block streams its bank's whole weights from L2 (about
3 GB at H=3, S=4096 for 1.5 GB of weights) and the L2 fabric is the bound; at BM=128 half the
traffic, but the rows are padded to 128 and the two warpgroups of one program wait for each
other every trip. Here a program has three partitions:

* the producer (the default partition, 4 warps, few registers): TMA loads of weight slices into
  a ring of ``STAGES`` slots, each slot released by an ``empty`` barrier of count 2;
* two consumers (4 warps each, ``CONSUMER_REGS`` registers by ``setmaxnreg``): each computes
  its own 64-row block exactly as the plain kernel does (same MMAs in the same order, so the
  same bits), and never waits for the other consumer.

Work comes in pairs of blocks (``build_pairs``): two blocks of one bank share one stream
(both consumers read every fill); two blocks of different banks get two streams interleaved
fill by fill (consumer 0 reads the even fills, consumer 1 the odd ones); a last lone block is
read by consumer 0 alone. Each consumer waits for every fill in order and arrives once on its
``empty`` barrier, at once for a fill it does not read, after that fill's down MMA for one it
reads: no consumer skips a fill, so parity waits never confuse two fills of one slot.

Triton 3.6 emits ``setmaxnreg`` for the partitions (producer 40, consumers 232), but ptxas
serialises every wgmma of the consumers ("insufficient register resources", C7512) although
the same consumer code alone needs 190 registers and pipelines (screen_gluon.py shows both).
Measured on the H200 (NOTES-perf.md version 10): bitwise equal, and 1.1-1.6x slower than the
Triton kernel. What was tried against the serialisation, each still C7512 with ptxas 12.8:
consumers at 240 registers; x from shared memory (the consumer then needs 207 in this form,
pipelined only when the whole function may use 255); one producer warp with consumer 0 as the
default partition (Triton pads the kernel to 12 warps anyway); the PTX edited by hand to give
the consumers 256, to drop ``.maxnreg``, or to declare ``.maxntid``/``.minnctapersm``.

``expert_mlp_gluon_ws2_kernel`` avoids ``setmaxnreg``. It runs 8 warps, and consumer 0 issues
the fills itself, so ptxas keeps the wgmmas pipelined. It is bitwise equal and 7-15% slower
than Triton: it reads 24% less from L2, but its L2 hit rate falls and it waits longer on
memory (Nsight Compute, version 10).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from gluon_mlp import _gather_block_x, _store_block_rows, _swiglu7


def build_pairs(block_bank: torch.Tensor, block_count: int):
    """``(first, second)`` int32 block indices per pair, in block order (so a bank's pairs run
    close together in time and meet in L2): two consecutive blocks of one bank pair up; a block
    left alone pairs with the next block left alone; a last lone one gets ``second = -1`` (it
    is last: the consumers' parity argument needs it there)."""
    banks = block_bank[:block_count].tolist()
    firsts, seconds = [], []
    pending = None  # a block left alone, waiting for the next one
    b = 0
    while b < block_count:
        if b + 1 < block_count and banks[b + 1] == banks[b]:
            firsts.append(b)
            seconds.append(b + 1)
            b += 2
            continue
        if pending is None:
            pending = b
        else:
            firsts.append(pending)
            seconds.append(b)
            pending = None
        b += 1
    if pending is not None:
        firsts.append(pending)
        seconds.append(-1)
    device = block_bank.device
    return (torch.tensor(firsts, dtype=torch.int32, device=device),
            torch.tensor(seconds, dtype=torch.int32, device=device))


@gluon.jit
def _pair_step(pair_first_ptr, pair_second_ptr, block_bank_ptr, q):
    first = gl.load(pair_first_ptr + q)
    second = gl.load(pair_second_ptr + q)
    bank_first = gl.load(block_bank_ptr + first)
    bank_second = gl.load(block_bank_ptr + gl.maximum(second, 0))
    interleaved = (second >= 0) & (bank_second != bank_first)
    return first, second, bank_first, bank_second, interleaved, 1 + interleaved.to(gl.int32)


@gluon.jit
def _read_fill(x, wg_smem, wu_smem, wd_smem, ready, empty, zero, acc, c, prev_c, has_prev,
               STAGES: gl.constexpr, a_layout: gl.constexpr):
    """One slice of this consumer's block from fill ``c``; releases its previous read fill
    ``prev_c`` once that fill's down MMA is complete."""
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    g = warpgroup_mma(x, wg_smem.index(s), zero, use_acc=False, is_async=True)
    u = warpgroup_mma(x, wu_smem.index(s), zero, use_acc=False, is_async=True)
    g, u, acc = warpgroup_mma_wait(num_outstanding=0, deps=(g, u, acc))
    mbarrier.arrive(empty.index(prev_c % STAGES), pred=has_prev)
    a = gl.convert_layout(_swiglu7(g, u).to(gl.bfloat16), a_layout)
    return warpgroup_mma(a, wd_smem.index(s), acc, is_async=True)


@gluon.jit
def _skip_fill(ready, empty, c, STAGES: gl.constexpr):
    """A fill the other consumer reads: seen, and released at once."""
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    mbarrier.arrive(empty.index(s))


@gluon.jit
def _load_fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready, empty, count, bank, j,
               HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
    """Fill ``count`` of the ring: slice ``j`` of ``bank``'s weights, once both consumers have
    released the slot's previous fill."""
    s = count % STAGES
    mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), 2 * 3 * HEAD_DIM * BLOCK_N)
    tma.async_copy_global_to_shared(wg_desc, [bank * HEAD_DIM, j * BLOCK_N], ready.index(s),
                                    wg_smem.index(s))
    tma.async_copy_global_to_shared(wu_desc, [bank * HEAD_DIM, j * BLOCK_N], ready.index(s),
                                    wu_smem.index(s))
    tma.async_copy_global_to_shared(wd_desc, [bank * INTER + j * BLOCK_N, 0], ready.index(s),
                                    wd_smem.index(s))


@gluon.jit
def _cursor_start(pair_first_ptr, pair_second_ptr, num_pairs, block_bank_ptr):
    """The fill cursor ``(pair, fill in pair, fills issued, bank a, bank b, streams)`` at this
    program's first pair."""
    pq = gl.program_id(0)
    _, _, bank_a, bank_b, _, streams = _pair_step(
        pair_first_ptr, pair_second_ptr, block_bank_ptr,
        gl.maximum(gl.minimum(pq, num_pairs - 1), 0))
    return pq, pq * 0, pq * 0, bank_a, bank_b, streams


@gluon.jit
def _issue_next(cursor, ring, pairs, HEAD_DIM: gl.constexpr, INTER: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The next fill in this program's order (as the producer partition issues them), if any;
    the cursor moved on. ``ring``: the descriptors, tiles and barriers; ``pairs``: the pair
    schedule (no constexprs in either tuple: Gluon would turn them into tensors)."""
    NJ: gl.constexpr = INTER // BLOCK_N
    wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready, empty = ring
    pair_first_ptr, pair_second_ptr, num_pairs, block_bank_ptr = pairs
    pq, pjj, pcount, bank_a, bank_b, streams = cursor
    if pq < num_pairs:
        bank = gl.where((pjj % streams) == 1, bank_b, bank_a)
        _load_fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready, empty, pcount,
                   bank, pjj // streams, HEAD_DIM, INTER, BLOCK_N, STAGES)
        pcount += 1
        pjj += 1
        if pjj == NJ * streams:
            pjj = pjj * 0
            pq += gl.num_programs(0)
            _, _, bank_a, bank_b, _, streams = _pair_step(
                pair_first_ptr, pair_second_ptr, block_bank_ptr,
                gl.minimum(pq, num_pairs - 1))
    return pq, pjj, pcount, bank_a, bank_b, streams


@gluon.jit
def _ws_producer(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready, empty,
                 pair_first_ptr, pair_second_ptr, pair_count_ptr, block_bank_ptr,
                 HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):
    NJ: gl.constexpr = INTER // BLOCK_N
    num_pairs = gl.load(pair_count_ptr)
    q = gl.program_id(0)
    count = 0
    while q < num_pairs:
        first, second, bank_a, bank_b, interleaved, streams = _pair_step(
            pair_first_ptr, pair_second_ptr, block_bank_ptr, q)
        for jj in range(NJ * streams):
            _load_fill(wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready, empty, count,
                       gl.where((jj % streams) == 1, bank_b, bank_a), jj // streams, HEAD_DIM,
                       INTER, BLOCK_N, STAGES)
            count += 1
        q += gl.num_programs(0)


@gluon.jit
def _ws_consumer(WHICH: gl.constexpr, PRODUCES: gl.constexpr, wg_desc, wu_desc, wd_desc,
                 x_ptr, x_smem, wg_smem, wu_smem, wd_smem, ready, empty,
                 gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
                 rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
                 pair_first_ptr, pair_second_ptr, pair_count_ptr,
                 HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, X_IN_REGISTERS: gl.constexpr):
    """Waits for every fill of the ring in order and arrives once on every fill's ``empty``
    barrier (after its MMAs for the fills it reads, at once for the others): a consumer never
    skips a fill, so parity waits cannot confuse two fills of one slot, and the producer
    never refills a slot a consumer has not seen."""
    NJ: gl.constexpr = INTER // BLOCK_N
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if X_IN_REGISTERS:
        x_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=gu_layout, k_width=2)
    else:
        x_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                                  warps_per_cta=[4, 1], order=[1, 0])

    num_pairs = gl.load(pair_count_ptr)
    cursor = _cursor_start(pair_first_ptr, pair_second_ptr, num_pairs, block_bank_ptr)
    ring = (wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready, empty)
    pairs = (pair_first_ptr, pair_second_ptr, num_pairs, block_bank_ptr)
    # Issuing: the first STAGES - 2 fills ahead, then one per fill consumed, so the slot being
    # refilled held the fill two back. One back would deadlock an interleaved pair: after
    # skipping fill 2j+1, consumer 0 would wait for its own release of fill 2j, which it gives
    # only at its next read.
    if PRODUCES:
        for i in gl.static_range(STAGES - 2):
            cursor = _issue_next(cursor, ring, pairs, HEAD_DIM, INTER, BLOCK_N, STAGES)
    q = gl.program_id(0)
    count = 0
    while q < num_pairs:
        first, second, bank_a, bank_b, interleaved, streams = _pair_step(
            pair_first_ptr, pair_second_ptr, block_bank_ptr, q)
        if WHICH == 0:
            block = first
            bank = bank_a
        else:
            block = second
            bank = bank_b
        mine = block >= 0
        safe_block = gl.maximum(block, 0)
        start = gl.load(block_start_ptr + safe_block)
        end = gl.where(mine, gl.load(offsets_ptr + bank.to(gl.int64) + 1), start)
        x = _gather_block_x(x_ptr, gather_ptr, start, end, bank, num_experts, stride_x,
                            x_layout, BLOCK_M, HEAD_DIM)
        if not X_IN_REGISTERS:
            # this consumer's own x tile: its previous block's MMAs are complete (waited)
            x_smem.index(WHICH).store(x)
            fence_async_shared()
            gl.thread_barrier()
            x = x_smem.index(WHICH)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, gu_layout)
        # three loops, so that no in-flight accumulator crosses a branch (ptxas then
        # serialises every wgmma)
        if interleaved:  # fills alternate: consumer 0 reads the even ones, 1 the odd ones
            acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
            for j in range(NJ):
                for t in gl.static_range(2):
                    c = count + 2 * j + t
                    if t == WHICH:
                        acc = _read_fill(x, wg_smem, wu_smem, wd_smem, ready, empty, zero, acc,
                                         c, c - 2, j > 0, STAGES, a_layout)
                    else:
                        _skip_fill(ready, empty, c, STAGES)
                    if PRODUCES:
                        cursor = _issue_next(cursor, ring, pairs, HEAD_DIM, INTER, BLOCK_N, STAGES)
            out = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        elif mine:  # one stream, read by both consumers (or by consumer 0 alone)
            acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
            for j in range(NJ):
                c = count + j
                acc = _read_fill(x, wg_smem, wu_smem, wd_smem, ready, empty, zero, acc,
                                 c, c - 1, j > 0, STAGES, a_layout)
                if PRODUCES:
                    cursor = _issue_next(cursor, ring, pairs, HEAD_DIM, INTER, BLOCK_N, STAGES)
            out = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            for j in range(NJ):
                _skip_fill(ready, empty, count + j, STAGES)
                if PRODUCES:
                    cursor = _issue_next(cursor, ring, pairs, HEAD_DIM, INTER, BLOCK_N, STAGES)
            out = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
        # the last read fill's down MMA is complete
        last = count + NJ * streams - 1 - interleaved.to(gl.int32) * (1 - WHICH)
        mbarrier.arrive(empty.index(last % STAGES), pred=mine)
        if mine:
            _store_block_rows(out, start, end, probs_ptr, slots_ptr, rows_ptr, slot_route_ptr,
                              stride_rows, BLOCK_M, HEAD_DIM)
        count += NJ * streams
        q += gl.num_programs(0)


@gluon.jit
def _allocate_ring(wg_desc, wu_desc, wd_desc, HEAD_DIM: gl.constexpr, INTER: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   X_IN_REGISTERS: gl.constexpr):
    """The weight ring (``STAGES`` slots of gate, up and down tiles), each consumer's x tile,
    and the ring's ``ready`` (count 1: the TMA bytes) and ``empty`` (count 2: one arrival per
    consumer) barriers."""
    gl.static_assert(BLOCK_M == 64, "each consumer warpgroup takes one 64-row block")
    gl.static_assert(STAGES % 2 == 0, "interleaved pairs need an even ring")
    gl.static_assert((INTER // BLOCK_N) % 2 == 0, "an even number of slices per stream")
    wg_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HEAD_DIM, BLOCK_N], wg_desc.layout)
    wu_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HEAD_DIM, BLOCK_N], wu_desc.layout)
    wd_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], wd_desc.layout)
    X_ROWS: gl.constexpr = 8 if X_IN_REGISTERS else BLOCK_M  # x in registers: no x tiles
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, X_ROWS, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([X_ROWS, HEAD_DIM],
                                                                            gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return wg_smem, wu_smem, wd_smem, x_smem, ready, empty


@gluon.jit
def _invalidate_ring(ready, empty, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def expert_mlp_gluon_ws_kernel(
    x_ptr, wg_desc, wu_desc, wd_desc,
    gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
    block_count_ptr, rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
    pair_first_ptr, pair_second_ptr, pair_count_ptr,
    HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, CONSUMER_REGS: gl.constexpr = 232,
    X_IN_REGISTERS: gl.constexpr = False,
):
    wg_smem, wu_smem, wd_smem, x_smem, ready, empty = _allocate_ring(
        wg_desc, wu_desc, wd_desc, HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES, X_IN_REGISTERS)

    # each partition's arguments written out in the call: a tuple kept in a variable turns the
    # constexprs in it into tensors (Triton 3.6's Gluon), which the partitions cannot use
    gl.warp_specialize([
        (_ws_producer, (wg_desc, wu_desc, wd_desc, wg_smem, wu_smem, wd_smem, ready, empty,
                        pair_first_ptr, pair_second_ptr, pair_count_ptr, block_bank_ptr,
                        HEAD_DIM, INTER, BLOCK_N, STAGES)),
        (_ws_consumer, (0, False, wg_desc, wu_desc, wd_desc, x_ptr, x_smem, wg_smem, wu_smem,
                        wd_smem, ready, empty, gather_ptr, probs_ptr, slots_ptr, offsets_ptr,
                        block_bank_ptr, block_start_ptr, rows_ptr, slot_route_ptr, stride_x,
                        stride_rows, num_experts, pair_first_ptr, pair_second_ptr,
                        pair_count_ptr, HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES,
                        X_IN_REGISTERS)),
        (_ws_consumer, (1, False, wg_desc, wu_desc, wd_desc, x_ptr, x_smem, wg_smem, wu_smem,
                        wd_smem, ready, empty, gather_ptr, probs_ptr, slots_ptr, offsets_ptr,
                        block_bank_ptr, block_start_ptr, rows_ptr, slot_route_ptr, stride_x,
                        stride_rows, num_experts, pair_first_ptr, pair_second_ptr,
                        pair_count_ptr, HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES,
                        X_IN_REGISTERS)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    _invalidate_ring(ready, empty, STAGES)


@gluon.jit
def expert_mlp_gluon_ws2_kernel(
    x_ptr, wg_desc, wu_desc, wd_desc,
    gather_ptr, probs_ptr, slots_ptr, offsets_ptr, block_bank_ptr, block_start_ptr,
    block_count_ptr, rows_ptr, slot_route_ptr, stride_x, stride_rows, num_experts,
    pair_first_ptr, pair_second_ptr, pair_count_ptr,
    HEAD_DIM: gl.constexpr, INTER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, num_warps: gl.constexpr, CONSUMER_REGS: gl.constexpr = 256,
    X_IN_REGISTERS: gl.constexpr = False,
):
    """The same pairs, fills and barriers with 8 warps and no producer partition: consumer 0
    (the default partition) also issues the fills, STAGES - 2 ahead of what it consumes. With
    256 threads every warp may hold 255 registers, so ptxas needs no ``setmaxnreg`` and keeps
    the wgmmas pipelined. Consumer 1 never waits for consumer 0 except through the ring."""
    wg_smem, wu_smem, wd_smem, x_smem, ready, empty = _allocate_ring(
        wg_desc, wu_desc, wd_desc, HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES, X_IN_REGISTERS)

    # the arguments written out, as in expert_mlp_gluon_ws_kernel (constexprs in a tuple
    # variable would turn into tensors)
    gl.warp_specialize([
        (_ws_consumer, (0, True, wg_desc, wu_desc, wd_desc, x_ptr, x_smem, wg_smem, wu_smem,
                        wd_smem, ready, empty, gather_ptr, probs_ptr, slots_ptr, offsets_ptr,
                        block_bank_ptr, block_start_ptr, rows_ptr, slot_route_ptr, stride_x,
                        stride_rows, num_experts, pair_first_ptr, pair_second_ptr,
                        pair_count_ptr, HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES,
                        X_IN_REGISTERS)),
        (_ws_consumer, (1, False, wg_desc, wu_desc, wd_desc, x_ptr, x_smem, wg_smem, wu_smem,
                        wd_smem, ready, empty, gather_ptr, probs_ptr, slots_ptr, offsets_ptr,
                        block_bank_ptr, block_start_ptr, rows_ptr, slot_route_ptr, stride_x,
                        stride_rows, num_experts, pair_first_ptr, pair_second_ptr,
                        pair_count_ptr, HEAD_DIM, INTER, BLOCK_M, BLOCK_N, STAGES,
                        X_IN_REGISTERS)),
    ], [4], [CONSUMER_REGS])
    _invalidate_ring(ready, empty, STAGES)
