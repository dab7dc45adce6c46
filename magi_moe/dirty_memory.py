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
* CPU: torch's own allocator switch (c10's ``caffe2_cpu_allocator_do_junk_fill``, set through
  ``libc10``'s exported flag for the duration of the call) fills every CPU tensor torch allocates,
  in any thread, from any malloc path, with the 4-byte pattern ``0x7FEDBEEF`` (NaN in float32;
  NaN and -0.47 in bfloat16 pairs; 1.7e308 in float64; huge in every integer dtype). Not glibc's
  perturb byte: glibc hands out blocks from its thread cache, and exact fits from its unsorted
  bin, without filling them, so a small tensor could still come back holding earlier data.

``MAGI_MOE_FRESH_MEMORY=1`` turns it off (debugging only: a finding that goes away with it is
an unwritten element). ``zeroed=True`` fills with zeros instead (on the CPU, c10's zero-fill
switch): what fresh memory looks like, for controls that must show a bug hidden on fresh memory.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from typing import Iterator

import torch

OFF_ENV = "MAGI_MOE_FRESH_MEMORY"
CUDA_FILL = 0xFF          # NaN in every float dtype
CPU_FILL = 0x7FEDBEEF     # c10's junk pattern, per 4 bytes (little-endian in memory)
SMALL_RESERVE = 32 << 20  # small-pool bytes (requests <= 1 MiB) made ready before each call
MAX_RESERVE = 4 << 30     # large-pool bytes at most (huge-input cases would ask for more)
_SMALL_REQUEST = 1 << 20  # the caching allocator's largest small-pool request


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
    elif device.type == "cpu" and _c10_fill_switches() is not None:
        with _cpu_fill("zero" if zeroed else "junk"):
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
    if device.type == "cpu" and _c10_fill_switches() is not None:
        return ("every CPU tensor torch allocates during the call, filled with 0x7FEDBEEF "
                "(NaN in float32)")
    return "nothing (this torch build's libc10 exports no fill switch)"


# ---------------------------------------------------------------------------------------------
# CPU: c10's fill switches
# ---------------------------------------------------------------------------------------------
_C10_LIBRARY = {"darwin": "libc10.dylib", "win32": "c10.dll"}.get(sys.platform, "libc10.so")
_switches = None


def _c10_fill_switches() -> dict[str, ctypes.c_bool] | None:
    """c10's two CPU allocator switches, ``{"junk": ..., "zero": ...}``, or None where this
    torch build does not export them (the allocator reads both on every allocation)."""
    global _switches
    if _switches is None:
        try:
            lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", _C10_LIBRARY))
            _switches = {
                kind: ctypes.c_bool.in_dll(lib, f"FLAGS_caffe2_cpu_allocator_do_{kind}_fill")
                for kind in ("junk", "zero")}
        except (OSError, ValueError):
            _switches = False
    return _switches or None


@contextlib.contextmanager
def _cpu_fill(kind: str) -> Iterator[None]:
    # Process-wide while set: other threads' tensors are filled too (harmless, they own them).
    # c10 aborts the process if it finds both switches on, so the other is turned off first.
    switches = _c10_fill_switches()
    before = {k: bool(s.value) for k, s in switches.items()}
    other = "zero" if kind == "junk" else "junk"
    switches[other].value = False
    switches[kind].value = True
    try:
        yield
    finally:
        switches[kind].value = False
        switches[other].value = before[other]
        switches[kind].value = before[kind]


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
