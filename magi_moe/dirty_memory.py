"""Used memory for every call the harness makes (docs/CONTRACT.md section 10).

An element a kernel leaves unwritten in a ``torch.empty`` buffer (an expert with no tokens, a
skipped tile) reads as zero on fresh memory and as garbage once the allocator hands back a used
block: the bug shows from the second step of a real run on, never in a test that runs each call
on fresh memory. :func:`handed_memory` makes the memory a call allocates read as poison instead:

* CUDA: every free block of the caching allocator's default pool on the current stream (and a
  reserve of ``reserve_bytes`` in the large pool plus :data:`SMALL_RESERVE` bytes in the small
  pool, made first so the call's requests are carved from filled blocks, not fresh ones) is
  claimed, filled with ``0xFF`` bytes (NaN in every float dtype, -1 in every integer one) and
  freed back. Cost: one allocator snapshot, one fill per free block (a few ms on an H200).
* CPU (glibc): ``mallopt(M_PERTURB)`` for the duration of the call, so glibc fills every block
  it hands out, heap or freshly mmapped, with ``0xFE`` bytes (-1.7e38 in float32 and bfloat16,
  NaN in float16). glibc cannot fill with ``0xFF`` (its perturb byte 0 means "off"). Blocks of
  up to 1032 bytes come from the thread's cache (tcache) unfilled, so the calling thread's cache
  is drained first (held, freed after the call); glibc 2.38 and later serve torch's aligned
  allocations from it too.

``MAGI_MOE_FRESH_MEMORY=1`` turns it off (debugging only: a finding that goes away with it is
an unwritten element). ``zeroed=True`` fills with zeros instead: what fresh memory looks like,
for controls that must show a bug hidden on fresh memory.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from typing import Iterator

import torch

OFF_ENV = "MAGI_MOE_FRESH_MEMORY"
CUDA_FILL = 0xFF          # NaN in every float dtype
CPU_FILL = 0xFE           # glibc fills with perturb ^ 0xFF: the perturb byte is 0x01
SMALL_RESERVE = 32 << 20  # small-pool bytes (requests <= 1 MiB) made ready before each call
MAX_RESERVE = 4 << 30     # large-pool bytes at most (huge-input cases would ask for more)
_SMALL_REQUEST = 1 << 20  # the caching allocator's largest small-pool request
_M_PERTURB = -6           # glibc's mallopt parameter
# glibc's thread cache: 64 size classes of 16 bytes (blocks up to 1032 bytes), 7 blocks each
# (glibc.malloc.tcache_count). A class is drained once two blocks in a row come back filled (a
# block from the cache comes back unfilled; taking one from a bin may refill the cache).
_TCACHE_SIZES = range(8, 1033, 16)
_MAX_DRAINED = 64  # blocks per class at most


def enabled() -> bool:
    """False when ``MAGI_MOE_FRESH_MEMORY`` is set to anything but ``0`` or empty."""
    return os.environ.get(OFF_ENV, "") in ("", "0")


@contextlib.contextmanager
def handed_memory(device: torch.device | str, *, reserve_bytes: int = 0,
                  zeroed: bool = False) -> Iterator[None]:
    """Inside, memory that ``device``'s allocator hands out reads as poison instead of whatever
    was there; ``reserve_bytes``: about what the call will ask for (CUDA). A no-op where nothing
    can be reached (:func:`reach`), while a CUDA graph captures, and when turned off by
    ``MAGI_MOE_FRESH_MEMORY``. ``zeroed=True`` (for controls; not turned off by the variable):
    zeros instead, as fresh memory reads."""
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be an int >= 0, got {reserve_bytes!r}")
    device = torch.device(device)
    if not enabled() and not zeroed:
        yield
    elif device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        fill_free_cuda_blocks(device, 0 if zeroed else CUDA_FILL, reserve_bytes)
        yield
    elif device.type == "cpu" and _mallopt() is not None:
        with _glibc_perturb(0xFF if zeroed else CPU_FILL ^ 0xFF):
            yield
    else:
        yield


def reach(device: torch.device | str) -> str:
    """What :func:`handed_memory` reaches on ``device``, in words."""
    device = torch.device(device)
    if not enabled():
        return f"off ({OFF_ENV} is set)"
    if device.type == "cuda":
        return "every free block of the caching allocator's default pool, filled with 0xFF (NaN)"
    if device.type == "cpu" and _mallopt() is not None:
        return "every block glibc malloc hands out during the call, filled with 0xFE"
    return "nothing (no glibc malloc on this CPU)"


# ---------------------------------------------------------------------------------------------
# CPU: glibc's perturb byte
# ---------------------------------------------------------------------------------------------
_libc = None


def _glibc():
    """glibc, or None (another C library: musl, macOS, Windows)."""
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.gnu_get_libc_version  # only glibc has it (and its M_PERTURB)
            libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
            libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
            libc.memcmp.restype = ctypes.c_int
            libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _mallopt():
    """glibc's ``mallopt``, or None."""
    libc = _glibc()
    return libc.mallopt if libc else None


def _environment_perturb() -> int:
    """The perturb byte the process started with (``MALLOC_PERTURB_``), restored afterwards."""
    try:
        return int(os.environ.get("MALLOC_PERTURB_", "0")) & 0xFF
    except ValueError:
        return 0


@contextlib.contextmanager
def _glibc_perturb(byte: int) -> Iterator[None]:
    # Process-wide while set: other threads' allocations are filled too (harmless, they own them).
    libc = _glibc()
    libc.mallopt(_M_PERTURB, byte)
    drained = _drain_thread_cache(libc, byte ^ 0xFF)
    try:
        yield
    finally:
        for block in drained:
            libc.free(block)
        libc.mallopt(_M_PERTURB, _environment_perturb())


def _drain_thread_cache(libc, fill: int) -> list[int]:
    """Take every block of the calling thread's malloc cache (the caller frees them after the
    call), so that the call's small blocks come from glibc's bins, which fill them. Nothing
    here allocates with malloc while draining (Python objects would be freed into the cache)."""
    held = (ctypes.c_void_p * (len(_TCACHE_SIZES) * _MAX_DRAINED))()
    want = ctypes.create_string_buffer(bytes([fill]) * _TCACHE_SIZES[-1])
    count = 0
    for size in _TCACHE_SIZES:
        filled = 0
        for _ in range(_MAX_DRAINED):
            held[count] = block = libc.malloc(size)
            count += 1
            filled = filled + 1 if libc.memcmp(block, want, size) == 0 else 0
            if filled == 2:
                break
    return list(held[:count])


# ---------------------------------------------------------------------------------------------
# CUDA: the caching allocator's free blocks
# ---------------------------------------------------------------------------------------------
def _free_blocks(device: torch.device) -> list[tuple[str, int]]:
    """``(segment_type, bytes)`` of each free block a request on this device and the current
    stream can be given: the default pool only (a CUDA graph's private pool serves its capture
    alone)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    found = []
    for seg in torch.cuda.memory_snapshot():
        if seg["device"] != device.index or seg.get("stream", stream) != stream:
            continue
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        found += [(seg["segment_type"], b["size"]) for b in seg["blocks"] if b["state"] == "inactive"]
    return found


def _requests(blocks: list[tuple[str, int]]) -> list[int]:
    """Request sizes that claim ``blocks``: largest first, so that best fit hands each request
    the block it was sized on; a small-pool block over 1 MiB in pieces the small pool serves."""
    sizes = []
    for kind, size in blocks:
        if kind == "small":
            while size > _SMALL_REQUEST:
                sizes.append(_SMALL_REQUEST)
                size -= _SMALL_REQUEST
        sizes.append(size)
    return sorted((s for s in sizes if s > 0), reverse=True)


def fill_free_cuda_blocks(device: torch.device, byte: int, reserve_bytes: int = 0) -> int:
    """Fill the allocator's free blocks on ``device`` with ``byte``, after making sure at least
    ``reserve_bytes`` (capped at :data:`MAX_RESERVE` and a quarter of the GPU's free memory: the
    reserve stays cached, out of other processes' reach) and :data:`SMALL_RESERVE` are there;
    returns the bytes filled."""
    device = torch.device("cuda", device.index if device.index is not None
                          else torch.cuda.current_device())
    with torch.cuda.device(device):
        free_on_gpu, _ = torch.cuda.mem_get_info(device)
        held = []
        if reserve_bytes:
            held.append(torch.empty(min(reserve_bytes, MAX_RESERVE, free_on_gpu // 4),
                                    dtype=torch.uint8, device=device))
        held += [torch.empty(_SMALL_REQUEST, dtype=torch.uint8, device=device)
                 for _ in range(SMALL_RESERVE // _SMALL_REQUEST)]
        held += [torch.empty(size, dtype=torch.uint8, device=device)
                 for size in _requests(_free_blocks(device))]
        for t in held:
            t.fill_(byte)
        filled = sum(t.numel() for t in held)
        del held  # back to the free lists, filled; the call's requests are carved from them
    return filled


def reserve_for(config, num_tokens: int, num_routes: int) -> int:
    """Bytes a call of the expert computation may ask the allocator for: twice its fp32 work
    (input, output, and per route a gate, up, activation and down row), plus 16 MiB."""
    per_route = 2 * config.intermediate_size + 2 * config.head_dim
    work = 4 * (2 * num_tokens * config.hidden_size + num_routes * per_route)
    return 2 * work + (16 << 20)
