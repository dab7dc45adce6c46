"""What the fused path's launch planner needs to know of a device, and the grids it sizes from it.

:class:`DeviceFacts` is the whole of it: tensor descriptors (TMA) or not, the shared memory one
program may use, the multiprocessor count. :func:`device_facts` reads them for a real device;
tests pass a record of their own to plan for a GPU this machine does not have.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..backends import interpreter_enabled

# The interpreter runs programs one after another: a persistent grid there gets a handful.
INTERPRETER_PROGRAMS = 4


@dataclass(frozen=True)
class DeviceFacts:
    """``tma``: tensor-descriptor loads run (Hopper and later, and the interpreter).
    ``shared_memory``: bytes one program may use (the opt-in maximum); None where no compiled
    kernel exists to measure (the interpreter). ``multiprocessors``: None off a GPU, where a
    persistent grid gets :data:`INTERPRETER_PROGRAMS` programs."""

    tma: bool
    shared_memory: int | None
    multiprocessors: int | None

    def __post_init__(self) -> None:
        if not isinstance(self.tma, bool):
            raise ValueError(f"DeviceFacts.tma must be a bool, got {self.tma!r}")
        for name in ("shared_memory", "multiprocessors"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"DeviceFacts.{name} must be a positive int or None, got {value!r}")


def tma_supported(device: torch.device) -> bool:
    """Descriptor loads run on Hopper and later, and under the interpreter."""
    if interpreter_enabled():
        return True
    return device.type == "cuda" and _capability(_index(device))[0] >= 9


@lru_cache(maxsize=None)
def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory one program may use on this GPU (the opt-in maximum)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


@lru_cache(maxsize=None)
def multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_facts(device: torch.device) -> DeviceFacts:
    """The facts of ``device`` (read each call; what is costly to read is cached per GPU)."""
    if device.type != "cuda":
        return DeviceFacts(tma=tma_supported(device), shared_memory=None, multiprocessors=None)
    index = _index(device)
    return DeviceFacts(tma=tma_supported(device),
                       shared_memory=shared_memory_limit(torch.device("cuda", index)),
                       multiprocessors=multiprocessors(index))


def persistent_grid(work_upper_bound: int, programs_per_sm: int,
                    device: torch.device | DeviceFacts) -> int:
    """Programs for a persistent kernel: enough to fill the GPU, never more than the work's
    upper bound (the interpreter runs programs one by one: a handful there)."""
    facts = device if isinstance(device, DeviceFacts) else device_facts(device)
    if facts.multiprocessors is not None:
        slots = facts.multiprocessors * programs_per_sm
    else:
        slots = INTERPRETER_PROGRAMS
    return max(1, min(work_upper_bound, slots))
