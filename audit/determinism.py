"""Determinism auditor (CONTRACT section 6): same input, same device, N runs, bitwise comparison.

Every run writes into a fresh NaN-poisoned output; elements whose bits differ from run 1 in any
run are counted. On CUDA a :class:`BackgroundLoad` keeps other work on the device (bf16 matmuls
on a side stream, launched before each run) so that block scheduling -- and with it the order
of atomic adds -- varies as in a serving process. An implementation declaring ``deterministic``
fails on any difference; the others are run for contrast and their spread is reported.
(On the CPU interpreter programs run one after another, so atomics never reorder there: only
a GPU run can fail an atomic "deterministic" mode.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from magi_moe.problems import Problem, bit_pattern, run_poisoned
from magi_moe.registry import Implementation

class BackgroundLoad:
    """Concurrent bf16 matmuls on a side stream while the audited implementation runs (CUDA)."""

    def __init__(self, device: torch.device, *, size: int = 4096, iterations: int = 8):
        if device.type != "cuda":
            raise ValueError(f"BackgroundLoad needs a CUDA device, got {device}")
        self.size, self.iterations = size, iterations
        gen = torch.Generator(device=device).manual_seed(0)
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
        self.c = torch.empty_like(self.a)
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def launch(self) -> None:
        """Queue the load on the side stream; returns at once, the work overlaps what follows."""
        with torch.cuda.stream(self.stream):
            for _ in range(self.iterations):
                torch.matmul(self.a, self.b, out=self.c)

    def finish(self) -> None:
        self.stream.synchronize()

    def describe(self) -> str:
        return f"{self.iterations} bf16 {self.size}^3 matmuls on a side stream during each run"


@dataclass
class DeterminismReport:
    label: str
    device: str
    runs: int
    elements: int
    differing: int        # elements whose bits differ from run 1 in at least one run
    runs_differing: int   # later runs with any difference
    max_abs_spread: float  # largest |run_k - run_1|
    background: str
    declared_deterministic: bool

    @property
    def ok(self) -> bool:
        return not self.declared_deterministic or self.differing == 0

    @property
    def fraction(self) -> float:
        return self.differing / self.elements if self.elements else 0.0

    def summary(self) -> str:
        claim = "declares deterministic" if self.declared_deterministic else "not declared deterministic"
        verdict = "ok" if self.ok else "NON-DETERMINISTIC"
        return (f"{self.label} on {self.device} ({claim}): {self.differing} of {self.elements} "
                f"elements ({self.fraction:.2%}) differ bitwise from run 1 over {self.runs} runs "
                f"({self.runs_differing} runs differ), max |diff| {self.max_abs_spread:.3g}; "
                f"background: {self.background or 'none'} -> {verdict}")

    def to_dict(self) -> dict:
        return dict(self.__dict__, ok=self.ok, fraction=self.fraction)


def audit_determinism(impl: Implementation, problem: Problem, *, runs: int = 20,
                      background: bool | None = None, label: str = "") -> DeterminismReport:
    """Run ``impl`` ``runs`` times on ``problem`` and count bitwise differences from run 1.

    ``background``: concurrent GPU work (default: on for CUDA, impossible elsewhere)."""
    return _reruns(lambda: run_poisoned(impl, problem), problem.x.device, runs=runs,
                   background=background, label=label or impl.name,
                   declared=impl.deterministic)


def audit_layer_determinism(layer: torch.nn.Module, x: torch.Tensor, *, runs: int = 20,
                            declared: bool, background: bool | None = None,
                            label: str = "") -> DeterminismReport:
    """The same reruns on a whole layer's forward (an implementation's own ``layer``: its
    routing, its cache and its kernels together)."""
    def forward() -> torch.Tensor:
        with torch.no_grad():
            return layer(x).clone()
    return _reruns(forward, x.device, runs=runs, background=background,
                   label=label or type(layer).__name__, declared=declared)


def _reruns(run, device: torch.device, *, runs: int, background: bool | None, label: str,
            declared: bool) -> DeterminismReport:
    if runs < 2:
        raise ValueError(f"runs must be >= 2, got {runs}")
    if background is None:
        background = device.type == "cuda"
    load = BackgroundLoad(device) if background else None

    def run_once() -> torch.Tensor:
        if load is not None:
            load.launch()
        out = run()
        if load is not None:
            load.finish()
        return out

    first = run_once()
    first_bits = bit_pattern(first)
    differs = torch.zeros_like(first_bits, dtype=torch.bool)
    runs_differing, spread = 0, 0.0
    for _ in range(runs - 1):
        out = run_once()
        diff = bit_pattern(out) != first_bits
        if bool(diff.any()):
            runs_differing += 1
            differs |= diff
            spread = max(spread, float((out.double() - first.double()).abs().nan_to_num(float("inf")).max()))
    return DeterminismReport(
        label=label, device=str(device), runs=runs, elements=first.numel(),
        differing=int(differs.sum()), runs_differing=runs_differing, max_abs_spread=spread,
        background=load.describe() if load is not None else "", declared_deterministic=declared)
