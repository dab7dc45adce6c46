"""The fused path's block schedule: which bank, and which of its routes, each row block holds.

``block_schedule_kernel`` reads the CSR offsets (or, ``FROM_COUNTS``, the per-bank route counts,
and writes the offsets first) and lists the blocks of ``BLOCK_M`` routes of every bank
``f = h*E + e`` into an upper-bound buffer, with the live block count in a one-element device
buffer that the expert kernels read; nothing goes back to the host.

Worked example (``BLOCK_M = 2``, three banks)::

    offsets      = [0, 3, 3, 4]     bank 0 holds routes 0..2, bank 1 none, bank 2 route 3
    block_bank   = [0, 0, 2]        bank 0 needs two blocks (3 routes), bank 2 one
    block_start  = [0, 2, 3]        the CSR index of each block's first route
    block_count  = [3, 3]           live blocks, of which BLOCK_M-row ones (all here)
    max_blocks   = cdiv(R, BLOCK_M) + min(H*E, R) = cdiv(4, 2) + min(3, 4) = 5

The buffers have ``max_blocks`` entries (each nonempty bank wastes less than one block, and at
most ``min(H*E, R)`` banks are nonempty); entries past ``block_count[0]`` are never read.

Mixed sizes (``SMALL_M``): with ``BLOCK_M = 4, SMALL_M = 2`` and offsets ``[0, 7, 10]`` (bank 0
holds 7 routes, bank 1 holds 3) bank 0 takes a big block at 0 and, its rest of 3 routes being
more than ``SMALL_M``, a second big block at 4; bank 1's 3 routes take a big block too. Offsets
``[0, 6, 7]`` give big blocks ``[(bank 0, 0)]`` then small ones ``[(bank 0, 4), (bank 1, 6)]``:
``block_count = [3, 1]``. Big blocks come first (they take longest, so a persistent grid starts
them first), and a bank's small block holds its last routes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..backends import interpreter_enabled
from .device import DeviceFacts, persistent_grid
from .workspace import FusedWorkspace


@triton.jit
def block_schedule_kernel(
    offsets_ptr,      # [H*E + 1] int64 CSR offsets: read, or written when FROM_COUNTS
    counts_ptr,       # [H*E] int32 routes per bank (read only when FROM_COUNTS)
    block_bank_ptr,   # [max_blocks] int32 out: bank of each live block
    block_start_ptr,  # [max_blocks] int64 out: CSR index of each live block's first route
    block_count_ptr,  # [2] int32 out: live blocks, and how many of them are BLOCK_M blocks
    num_banks,
    max_blocks,
    BLOCK_M: tl.constexpr,
    SMALL_M: tl.constexpr,     # 0, or the rows of a bank's last block when its rest fits
    BANKS_PAD: tl.constexpr,   # power of two >= num_banks
    SLOTS: tl.constexpr,       # schedule slots filled by each program
    FROM_COUNTS: tl.constexpr,
):
    # Every program works out all banks' block ranges (a cumsum over H*E values) and fills
    # chunks of SLOTS schedule entries: no program waits on another, and none loops over the
    # busiest bank's blocks (the one-program form took 36 us at S=16384, NOTES-perf.md). The
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
    # Big blocks (BLOCK_M rows) first, all banks; then, with SMALL_M, one small block per bank
    # whose last rest of routes fits SMALL_M rows: a block reads its bank's whole weights, so
    # big blocks halve the weight traffic of busy banks while the rests pad to SMALL_M only.
    rest = counts % BLOCK_M
    if SMALL_M > 0:
        small = ((rest > 0) & (rest <= SMALL_M)).to(tl.int64)
        blocks = counts // BLOCK_M + (rest > SMALL_M).to(tl.int64)
    else:
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
    blocks_end = tl.cumsum(blocks, 0)
    num_big = tl.sum(blocks, 0)
    total = num_big
    if SMALL_M > 0:
        small_end = tl.cumsum(small, 0)
        total += tl.sum(small, 0)
    # A malformed table could claim more blocks than the buffer holds: never run past it.
    live_blocks = tl.minimum(total, max_blocks)
    if pid == 0:
        tl.store(block_count_ptr, live_blocks.to(tl.int32))
        tl.store(block_count_ptr + 1, tl.minimum(num_big, live_blocks).to(tl.int32))
    # Bank f owns big slots blocks_end[f] - blocks[f] .. blocks_end[f] - 1; slot j of it starts
    # at route starts[f] + j * BLOCK_M, i.e. at base[f] + slot * BLOCK_M. Its small block (slot
    # num_big + small_end[f] - 1) starts after its big ones.
    base = starts - (blocks_end - blocks) * BLOCK_M
    # while, not range(): Triton 3.6's interpreter takes no tensor bounds (CONTRACT section 8).
    num_chunks = tl.cdiv(live_blocks, SLOTS)
    chunk = pid
    while chunk < num_chunks:
        slot = tl.cast(chunk, tl.int64) * SLOTS + tl.arange(0, SLOTS).to(tl.int64)
        owner = ((slot[:, None] >= (blocks_end - blocks)[None, :])
                 & (slot[:, None] < blocks_end[None, :]))
        bank = tl.sum(tl.where(owner, f[None, :], 0), 1)
        start = tl.sum(tl.where(owner, base[None, :], 0), 1) + tl.where(slot < num_big,
                                                                           slot * BLOCK_M, 0)
        if SMALL_M > 0:
            index = slot - num_big  # negative for big slots: no bank owns it
            owns = ((index[:, None] >= (small_end - small)[None, :])
                    & (index[:, None] < small_end[None, :]))
            bank += tl.sum(tl.where(owns, f[None, :], 0), 1)
            start += tl.sum(tl.where(owns, (starts + blocks * BLOCK_M)[None, :], 0), 1)
        m = slot < live_blocks
        tl.store(block_bank_ptr + slot, bank.to(tl.int32), mask=m)
        tl.store(block_start_ptr + slot, start, mask=m)
        chunk += tl.num_programs(0)


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a JIT callable: microseconds a call,
    and the launch plan is made on every forward)."""
    return -(-a // b)


def max_blocks(num_routes: int, num_banks: int, block_m: int, small_m: int = 0) -> int:
    """Upper bound on the live blocks known without reading the counts: each nonempty bank
    wastes less than one block, and at most ``min(H*E, R)`` banks are nonempty. With
    ``small_m`` every big block but the small ones holds more than ``small_m`` routes, so the
    bound of ``small_m``-row blocks holds."""
    return cdiv(num_routes, small_m or block_m) + min(num_banks, num_routes)


@dataclass(frozen=True)
class BlockSchedule:
    """Device-side block schedule: ``block_bank`` int32 and ``block_start`` int64
    ``[max_blocks]`` (valid below the live count), ``block_count`` int32 ``[2]`` (the live
    count, then how many of them come first as ``block_m``-row blocks; never read by the host);
    ``max_blocks`` is the host-side upper bound. ``small_m`` (0: none): the live blocks past
    the big ones are each a bank's last ``small_m`` or fewer routes (kernels that do not tell
    the two apart read every block as ``block_m`` rows, masked at the bank's end: the same
    routes)."""

    block_bank: torch.Tensor
    block_start: torch.Tensor
    block_count: torch.Tensor
    block_m: int
    small_m: int = 0

    @property
    def max_blocks(self) -> int:
        return self.block_bank.numel()


def schedule_buffers(workspace: FusedWorkspace, num_routes: int, num_banks: int,
                     block_m: int, small_m: int = 0) -> BlockSchedule:
    """The workspace buffers a schedule for this problem is built into (nothing launched)."""
    nb = max_blocks(num_routes, num_banks, block_m, small_m)
    return BlockSchedule(workspace.get("block_bank", (nb,), torch.int32),
                         workspace.get("block_start", (nb,), torch.int64),
                         workspace.get("block_count", (2,), torch.int32), block_m, small_m)


def _launch_shape(num_blocks_bound: int, num_banks: int,
                  device: torch.device | DeviceFacts) -> tuple[int, int, int, int]:
    """(programs, slots per program, warps, padded bank count) of one schedule launch."""
    pad = max(16, 1 << (num_banks - 1).bit_length())  # a power of two >= num_banks
    # Each program holds a [slots, banks] ownership mask: about 64 elements per thread on a
    # GPU; the interpreter pays per program, so it takes larger ones.
    interpreted = interpreter_enabled()
    slots = 64 if interpreted else max(1, min(64, 16384 // pad))
    warps = 1 if interpreted else 8
    return persistent_grid(cdiv(num_blocks_bound, slots), 2, device), slots, warps, pad


def schedule_programs(num_routes: int, num_banks: int, block_m: int, facts: DeviceFacts,
                      small_m: int = 0) -> int:
    """The grid of :func:`fill_block_schedule` for this problem on a device with ``facts``."""
    return _launch_shape(max_blocks(num_routes, num_banks, block_m, small_m), num_banks,
                         facts)[0]


def fill_block_schedule(schedule: BlockSchedule, offsets: torch.Tensor, num_banks: int, *,
                        counts: torch.Tensor | None = None) -> None:
    """Build ``schedule`` from ``offsets`` (or, with ``counts``, write ``offsets`` first from the
    per-bank route counts). One launch; nothing read back."""
    nb = schedule.max_blocks
    programs, slots, warps, pad = _launch_shape(nb, num_banks, offsets.device)
    block_schedule_kernel[(programs,)](
        offsets, counts if counts is not None else offsets, schedule.block_bank,
        schedule.block_start, schedule.block_count, num_banks, nb,
        BLOCK_M=schedule.block_m, SMALL_M=schedule.small_m, BANKS_PAD=pad, SLOTS=slots, FROM_COUNTS=counts is not None,
        num_warps=warps,
    )


def launch_block_schedule(offsets: torch.Tensor, num_routes: int, num_banks: int, block_m: int,
                          workspace: FusedWorkspace, *, counts: torch.Tensor | None = None,
                          small_m: int = 0) -> BlockSchedule:
    """:func:`schedule_buffers` then :func:`fill_block_schedule`: the schedule, built."""
    schedule = schedule_buffers(workspace, num_routes, num_banks, block_m, small_m)
    fill_block_schedule(schedule, offsets, num_banks, counts=counts)
    return schedule
