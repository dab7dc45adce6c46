"""Discipline auditor (CUDA): what a warm forward may not do (CONTRACT section 4).

* No host synchronisation: one warm forward runs under
  ``torch.cuda.set_sync_debug_mode("error")``, which raises on ``.item()``, ``.tolist()``,
  ``nonzero``, blocking copies to the host and the like.
* No per-call allocations: ``torch.cuda.memory_stats()``'s allocation counter
  (``allocation.all.allocated``) must not move across warm forwards into a caller-owned
  output; a whole-layer forward may allocate only the output it returns.
* ``torch.compile``: a compiled layer must run and give the reference's answer (within the
  worst-case bound), whichever path the dispatcher falls back to under compilation.

Implementations declaring ``no_host_sync`` are held to the first two; for the others the
numbers are reported for contrast (the native kernel sizes its grid on the host, by design).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from magi_moe.problems import Problem
from magi_moe.registry import Implementation


ALLOCATION_COUNTER = "allocation.all.allocated"
BYTES_COUNTER = "allocated_bytes.all.allocated"


@dataclass
class DisciplineReport:
    label: str
    device: str
    declares_no_host_sync: bool
    host_sync: bool
    sync_detail: str
    allocations_per_call: float
    bytes_per_call: float
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if not self.declares_no_host_sync:
            return True
        return not self.host_sync and self.allocations_per_call == 0

    def summary(self) -> str:
        claim = "declares no_host_sync" if self.declares_no_host_sync else "no discipline declared"
        sync = f"host sync: {self.sync_detail}" if self.host_sync else "no host sync"
        return (f"{self.label} on {self.device} ({claim}): {sync}; "
                f"{self.allocations_per_call:g} allocations ({self.bytes_per_call:.3g} bytes) per "
                f"warm call -> {'ok' if self.ok else 'VIOLATION'}")

    def to_dict(self) -> dict:
        return dict(self.__dict__, ok=self.ok)


def _measure(forward: Callable[[], object], device: torch.device, *, warmup: int,
             calls: int) -> tuple[bool, str, float, float]:
    """(host sync seen, its message, allocations per call, bytes per call) of warm ``forward``."""
    for _ in range(warmup):
        forward()
    torch.cuda.synchronize(device)

    previous = torch.cuda.get_sync_debug_mode()
    host_sync, detail = False, ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()
    except RuntimeError as exc:
        host_sync, detail = True, str(exc).strip().splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(device)

    before = torch.cuda.memory_stats(device)
    for _ in range(calls):
        forward()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_stats(device)
    count = lambda key: (after.get(key, 0) - before.get(key, 0)) / calls  # noqa: E731
    return host_sync, detail, count(ALLOCATION_COUNTER), count(BYTES_COUNTER)


def audit_discipline(impl: Implementation, problem: Problem, *, warmup: int = 3,
                     calls: int = 5) -> DisciplineReport:
    """Sync and allocation discipline of ``impl`` on ``problem`` (which must be on CUDA), with a
    caller-owned output: a disciplined implementation allocates nothing per call."""
    device = problem.x.device
    if device.type != "cuda":
        raise ValueError(f"the discipline auditor needs a CUDA problem, got device {device}")
    x, table, weights, config = problem.x, problem.table, problem.weights, problem.config
    out = torch.empty(x.shape, dtype=impl.output_dtype(x.dtype), device=device)
    host_sync, detail, allocs, nbytes = _measure(
        lambda: impl(x, table, weights, config, out=out), device, warmup=warmup, calls=calls)
    return DisciplineReport(
        label=impl.name, device=str(device),
        declares_no_host_sync="no_host_sync" in impl.capabilities,
        host_sync=host_sync, sync_detail=detail,
        allocations_per_call=allocs, bytes_per_call=nbytes)


def audit_layer_discipline(make_layer: Callable[[], torch.nn.Module], *, num_tokens: int = 4096,
                           seed: int = 0, label: str = "", warmup: int = 3,
                           calls: int = 5, config=None) -> DisciplineReport:
    """The whole layer forward (routing included) of a CUDA layer: no host sync, and at most one
    allocation per call -- the returned output (reported as allocations beyond it). ``config``:
    the layer's configuration (default ``layer.config``, for layers that carry one)."""
    layer = make_layer()
    device = next(layer.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"the discipline auditor needs a CUDA layer, got device {device}")
    cfg = config if config is not None else layer.config
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, cfg.hidden_size, generator=gen).to(dtype=cfg.dtype, device=device)
    with torch.no_grad():
        host_sync, detail, allocs, nbytes = _measure(lambda: layer(x), device, warmup=warmup,
                                                     calls=calls)
    out_bytes = num_tokens * cfg.hidden_size * x.element_size()
    return DisciplineReport(
        label=label or type(layer).__name__, device=str(device), declares_no_host_sync=True,
        host_sync=host_sync, sync_detail=detail, allocations_per_call=max(allocs - 1, 0),
        bytes_per_call=max(nbytes - out_bytes, 0),
        notes=["layer forward: the returned output (one allocation) is not counted"])


@dataclass
class CompileReport:
    label: str
    status: str   # "pass" / "FAIL"
    detail: str

    @property
    def ok(self) -> bool:
        return self.status != "FAIL"

    def summary(self) -> str:
        return f"torch.compile({self.label}): {self.status}: {self.detail}"

    def to_dict(self) -> dict:
        return dict(self.__dict__, ok=self.ok)


def audit_compile(make_layer: Callable[[], torch.nn.Module], *, num_tokens: int = 256,
                  seed: int = 0, label: str = "", config=None) -> CompileReport:
    """Compile the layer ``make_layer()`` builds, run it, and check its output against the float64
    reference on the layer's weights (routing recomputed from its state dict)."""
    from .cache import layer_output_ok

    layer = make_layer()
    label = label or type(layer).__name__
    cfg = config if config is not None else layer.config
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, cfg.hidden_size, generator=gen).to(
        dtype=cfg.dtype, device=next(layer.parameters()).device)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(layer)
        y = compiled(x)
        y = compiled(x)  # the second call runs the cached graph
    except Exception as exc:  # noqa: BLE001 -- a compile failure is the finding
        return CompileReport(label, "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    ok, how = layer_output_ok(layer, x, y, config=cfg)
    return CompileReport(label, "pass" if ok else "FAIL", f"compiled output vs float64 reference: {how}")
