"""The fused path's block schedule: which bank, and which of its routes, each row block holds.

``block_schedule_kernel`` reads the CSR offsets (or, ``FROM_COUNTS``, the per-bank route counts,
and writes the offsets first) and lists the blocks of ``BLOCK_M`` routes of every bank
``f = h*E + e`` into an upper-bound buffer, with the live block count in a one-element device
buffer that the expert kernels read; nothing goes back to the host.

Worked example (``BLOCK_M = 2``, three banks)::

    offsets      = [0, 3, 3, 4]     bank 0 holds routes 0..2, bank 1 none, bank 2 route 3
    block_bank   = [0, 0, 2]        bank 0 needs two blocks (3 routes), bank 2 one
    block_start  = [0, 2, 3]        the CSR index of each block's first route
    block_count  = 3
    max_blocks   = cdiv(R, BLOCK_M) + min(H*E, R) = cdiv(4, 2) + min(3, 4) = 5

The buffers have ``max_blocks`` entries (each nonempty bank wastes less than one block, and at
most ``min(H*E, R)`` banks are nonempty); entries past ``block_count`` are never read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backends import interpreter_enabled
from .device import DeviceFacts, persistent_grid
from .launch_steps import BlockSchedule, FusedCall, Launcher, LaunchStep
from .workspace import FusedWorkspace


@triton.jit
def block_schedule_kernel(
    offsets_ptr,      # [H*E + 1] int64 CSR offsets: read, or written when FROM_COUNTS
    counts_ptr,       # [H*E] int32 routes per bank (read only when FROM_COUNTS)
    block_bank_ptr,   # [max_blocks] int32 out: bank of each live block
    block_start_ptr,  # [max_blocks] int64 out: CSR index of each live block's first route
    block_count_ptr,  # [1] int32 out: the live block count (read by the expert kernels)
    num_banks,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BANKS_PAD: tl.constexpr,   # power of two >= num_banks
    SLOTS: tl.constexpr,       # schedule slots filled by each program
    FROM_COUNTS: tl.constexpr,
):
    # Every program works out all banks' block ranges (a cumsum over H*E values) and fills
    # chunks of SLOTS schedule entries: no program waits on another, and none loops over the
    # busiest bank's blocks (the one-program form took 36 us at S=16384, docs/PERFORMANCE.md). The
    # grid is capped (the launcher's choice) so the cumsum is not redone thousands of times.
    pid = tl.program_id(0)
    f = tl.arange(0, BANKS_PAD)
    live = f < num_banks
    if FROM_COUNTS:
        counts = tl.load(counts_ptr + f, mask=live, other=0).to(tl.int64)
        ends = tl.cumsum(counts, 0)
        starts = ends - counts
        if pid == 0:
            tl.store(offsets_ptr + 1 + f, ends, mask=live)
            tl.store(offsets_ptr + f, starts, mask=f == 0)
    else:
        starts = tl.load(offsets_ptr + f, mask=live, other=0)
        counts = tl.load(offsets_ptr + 1 + f, mask=live, other=0) - starts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    blocks_end = tl.cumsum(blocks, 0)
    # A malformed table could claim more blocks than the buffer holds: never run past it.
    live_blocks = tl.minimum(tl.sum(blocks, 0), max_blocks)
    if pid == 0:
        tl.store(block_count_ptr, live_blocks.to(tl.int32))
    # Bank f owns slots blocks_end[f] - blocks[f] .. blocks_end[f] - 1; slot j of it starts
    # at route starts[f] + j * BLOCK_M, i.e. at base[f] + slot * BLOCK_M.
    base = starts - (blocks_end - blocks) * BLOCK_M
    # while, not range(): Triton 3.6's interpreter takes no tensor bounds (CONTRACT section 8).
    num_chunks = tl.cdiv(live_blocks, SLOTS)
    chunk = pid
    while chunk < num_chunks:
        slot = tl.cast(chunk, tl.int64) * SLOTS + tl.arange(0, SLOTS).to(tl.int64)
        owner = ((slot[:, None] >= (blocks_end - blocks)[None, :])
                 & (slot[:, None] < blocks_end[None, :]))
        bank = tl.sum(tl.where(owner, f[None, :], 0), 1)
        start = tl.sum(tl.where(owner, base[None, :], 0), 1) + slot * BLOCK_M
        m = slot < live_blocks
        tl.store(block_bank_ptr + slot, bank.to(tl.int32), mask=m)
        tl.store(block_start_ptr + slot, start, mask=m)
        chunk += tl.num_programs(0)


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a JIT callable: microseconds a call,
    and the launch plan is made on every forward)."""
    return -(-a // b)


def max_blocks(num_routes: int, num_banks: int, block_m: int) -> int:
    """Upper bound on ``sum_f cdiv(count_f, block_m)`` known without reading the counts: each
    nonempty bank wastes less than one block, and at most ``min(H*E, R)`` banks are nonempty."""
    return cdiv(num_routes, block_m) + min(num_banks, num_routes)


def schedule_buffers(workspace: FusedWorkspace, num_routes: int, num_banks: int,
                     block_m: int) -> BlockSchedule:
    """The workspace buffers a schedule for this problem is built into (nothing launched)."""
    nb = max_blocks(num_routes, num_banks, block_m)
    return BlockSchedule(workspace.get("block_bank", (nb,), torch.int32),
                         workspace.get("block_start", (nb,), torch.int64),
                         workspace.get("block_count", (1,), torch.int32), block_m)


def _launch_shape(num_blocks_bound: int, num_banks: int,
                  device: torch.device | DeviceFacts) -> tuple[int, int, int, int]:
    """(programs, slots per program, warps, padded bank count) of one schedule launch."""
    pad = max(16, 1 << (num_banks - 1).bit_length())  # a power of two >= num_banks
    # Each program holds a [slots, banks] ownership mask: about 64 elements per thread on a
    # GPU; the interpreter pays per program, so it takes larger ones.
    interpreted = interpreter_enabled()
    slots = 64 if interpreted else max(1, min(64, 16384 // pad))
    warps = 1 if interpreted else 8
    chunks = cdiv(num_blocks_bound, slots)
    return persistent_grid(chunks, 2, device), slots, warps, pad


def schedule_programs(num_routes: int, num_banks: int, block_m: int, facts: DeviceFacts) -> int:
    """The grid of :func:`fill_block_schedule` for this problem on a device with ``facts``."""
    bound = max_blocks(num_routes, num_banks, block_m)
    return _launch_shape(bound, num_banks, facts)[0]


def fill_block_schedule(schedule: BlockSchedule, offsets: torch.Tensor, num_banks: int, *,
                        counts: torch.Tensor | None = None) -> None:
    """Build ``schedule`` from ``offsets`` (or, with ``counts``, write ``offsets`` first from the
    per-bank route counts). One launch; nothing read back."""
    nb = schedule.max_blocks
    programs, slots, warps, pad = _launch_shape(nb, num_banks, offsets.device)
    block_schedule_kernel[(programs,)](
        offsets, counts if counts is not None else offsets, schedule.block_bank,
        schedule.block_start, schedule.block_count, num_banks, nb,
        BLOCK_M=schedule.block_m, BANKS_PAD=pad, SLOTS=slots, FROM_COUNTS=counts is not None,
        num_warps=warps,
    )


def launch_block_schedule(offsets: torch.Tensor, num_routes: int, num_banks: int, block_m: int,
                          workspace: FusedWorkspace, *, counts: torch.Tensor | None = None
                          ) -> BlockSchedule:
    """:func:`schedule_buffers` then :func:`fill_block_schedule`: the schedule, built."""
    schedule = schedule_buffers(workspace, num_routes, num_banks, block_m)
    fill_block_schedule(schedule, offsets, num_banks, counts=counts)
    return schedule


def _launch_schedule(step: LaunchStep, call: FusedCall) -> None:
    """The plan's schedule step: ``call.schedule`` built from the table's offsets."""
    fill_block_schedule(call.schedule, call.table.offsets, call.config.num_banks)


SCHEDULE = Launcher("block_schedule_kernel", _launch_schedule)
