"""Floating-point formats and the precision models of CONTRACT section 1, as data.

A :class:`PrecisionModel` says where an implementation rounds and in which format it
accumulates; :mod:`magi_moe.judge.bounds` turns it into per-element error bounds. The registry's
``Implementation.precision`` strings name the models (``precision_model(name, dtype)``).

Rounding follows the standard model with gradual underflow (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., eq. (2.8)): ``fl(v) = v (1 + d) + e`` with ``|d| <= unit`` and
``|e| <= underflow`` (half the smallest subnormal), so ``|fl(v) - v| <= unit |v| + underflow``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from magi_moe.registry import PRECISION_MODELS


@dataclass(frozen=True)
class FloatFormat:
    """A binary format with ``bits`` significand bits (implicit bit included) and least normal
    exponent ``emin``. ``unit = 2^-bits`` is the unit roundoff of round-to-nearest."""

    name: str
    bits: int
    emin: int
    flush_subnormals: bool = False

    @property
    def unit(self) -> float:
        return 2.0 ** -self.bits

    @property
    def underflow(self) -> float:
        """Largest absolute rounding error in the subnormal range: half the subnormal spacing,
        or, where subnormal operands and results are flushed to zero, the least normal value."""
        if self.flush_subnormals:
            return 2.0 ** self.emin
        return 2.0 ** (self.emin - self.bits)

    def rounding_error(self, magnitude: torch.Tensor) -> torch.Tensor:
        """Bound on ``|fl(v) - v|`` for ``|v| <= magnitude``."""
        return self.unit * magnitude + self.underflow


BF16 = FloatFormat("bf16", bits=8, emin=-126)
FP16 = FloatFormat("fp16", bits=11, emin=-14)
FP32 = FloatFormat("fp32", bits=24, emin=-126)
# fp32 atomic adds on NVIDIA GPUs flush subnormal inputs and results to zero (PTX ISA, atom /
# red .add.f32); the fuzzers found a subnormal routing weight's contribution lost that way.
FP32_FTZ = FloatFormat("fp32-ftz", bits=24, emin=-126, flush_subnormals=True)
FP64 = FloatFormat("fp64", bits=53, emin=-1022)

FORMAT_OF_DTYPE = {torch.bfloat16: BF16, torch.float16: FP16, torch.float32: FP32, torch.float64: FP64}

# fp32 accumulators get twice fp32's unit roundoff: it also covers adders that truncate instead
# of rounding to nearest, as NVIDIA tensor cores do (Fasi, Higham, Mikaitis & Pranesh, 2021).
# These terms are ~1e-4 of the total bound, so the allowance costs nothing.
FP32_ACCUMULATOR_UNIT = 2 * FP32.unit


def format_of(dtype: torch.dtype) -> FloatFormat:
    """The format of a torch dtype: the one dtype table (unit roundoff, significand bits) the
    judge, the fuzzers and the tests all read."""
    try:
        return FORMAT_OF_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {list(FORMAT_OF_DTYPE)}, got {dtype}") from None


def unit_roundoff(dtype: torch.dtype) -> float:
    """Round-to-nearest's unit roundoff of ``dtype``: 2^-8 for bf16, 2^-11 fp16, 2^-24 fp32."""
    return format_of(dtype).unit


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at each value's magnitude (one unit in the last place), in
    float64; at least the subnormal spacing."""
    fmt = format_of(dtype)
    exponent = torch.floor(torch.log2(values.abs().double().clamp_min(2.0 ** fmt.emin)))
    return torch.exp2(exponent - (fmt.bits - 1))


@dataclass(frozen=True)
class PrecisionModel:
    """Where an implementation of the expert computation rounds (CONTRACT section 1).

    ``accumulate`` / ``accumulate_unit``: format and unit roundoff of the sums over ``Dh``
    (gate/up), over ``I`` (down) and over the top-k routes.
    ``evaluate``: format of elementwise work (SwiGLU7, the routing weight product).
    ``round_*``: the format a value is rounded to at that point, or None when it stays in the
    accumulator: ``gate_up`` (g and u before SwiGLU7), ``activation`` (SwiGLU7's output, the
    down-projection operand), ``down`` (the down-projection result), ``route`` (each route's
    weighted contribution), ``output`` (the final result).
    """

    name: str
    accumulate: FloatFormat
    accumulate_unit: float
    evaluate: FloatFormat
    round_gate_up: FloatFormat | None = None
    round_activation: FloatFormat | None = None
    round_down: FloatFormat | None = None
    round_route: FloatFormat | None = None
    round_output: FloatFormat | None = None

    def __post_init__(self) -> None:
        if not self.accumulate_unit >= self.accumulate.unit:
            raise ValueError(f"PrecisionModel {self.name!r}: accumulate_unit must be at least "
                             f"{self.accumulate.name}'s unit roundoff {self.accumulate.unit}")

    def describe(self) -> str:
        rounds = [f"{point}->{fmt.name}" for point, fmt in (
            ("g,u", self.round_gate_up), ("act", self.round_activation), ("down", self.round_down),
            ("route", self.round_route), ("out", self.round_output)) if fmt is not None]
        return (f"{self.name}: accumulate {self.accumulate.name} (u={self.accumulate_unit:.3g}), "
                f"evaluate {self.evaluate.name}, rounds {', '.join(rounds) or 'nowhere'}")


def precision_model(name: str | PrecisionModel, dtype: torch.dtype = torch.bfloat16) -> PrecisionModel:
    """The model an implementation declares (``Implementation.precision``) at input ``dtype``.

    ``float64``: the oracle, float64 throughout, no rounding to a narrow format.
    ``bf16-fp32acc``: the fast paths: fp32 accumulation, SwiGLU7 in fp32 rounded once to the
    working dtype, routing weight and top-k sum in fp32, one final rounding.
    ``bf16-fp32acc-atomic``: ``bf16-fp32acc`` whose fp32 sums may flush subnormals (the
    top-k sum by atomics): an absolute 2^-126 per addition instead of 2^-150.
    ``bf16-plain``: the plain PyTorch baseline: additionally rounds g and u, the down result and
    each route's contribution to the working dtype.
    """
    if isinstance(name, PrecisionModel):
        return name
    if isinstance(name, str) and name.endswith("+rz"):
        return with_truncating_downcasts(precision_model(name.removesuffix("+rz"), dtype))
    work = format_of(dtype)
    if name == "float64":
        return PrecisionModel("float64", FP64, FP64.unit, FP64)
    if name in ("bf16-fp32acc", "bf16-fp32acc-atomic"):
        accumulate = FP32_FTZ if name.endswith("atomic") else FP32
        return PrecisionModel(name, accumulate, FP32_ACCUMULATOR_UNIT, FP32,
                              round_activation=work, round_output=work)
    if name == "bf16-plain":
        return PrecisionModel(name, FP32, FP32_ACCUMULATOR_UNIT, FP32, round_gate_up=work,
                              round_activation=work, round_down=work, round_route=work,
                              round_output=work)
    raise ValueError(f"precision model must be one of {PRECISION_MODELS}, got {name!r}")


def truncating(fmt: FloatFormat) -> FloatFormat:
    """Rounding toward zero to ``bits`` bits errs by less than one ulp: the bound of rounding to
    nearest with ``bits - 1`` bits (same exponent range)."""
    return FloatFormat(fmt.name + "-rz", fmt.bits - 1, fmt.emin)


def with_truncating_downcasts(model: PrecisionModel) -> PrecisionModel:
    """``model`` with every rounding to a narrow format done toward zero. The Triton interpreter
    (3.9) converts fp32 to bf16 by truncation, where compiled Triton rounds to nearest even
    (``audit.selfcheck`` detects which); kernels run under it are held to this model."""
    if model.name.endswith("+rz"):
        return model
    points = ("round_gate_up", "round_activation", "round_down", "round_route", "round_output")
    changes = {p: truncating(getattr(model, p)) for p in points if getattr(model, p) is not None}
    return dataclasses.replace(model, name=model.name + "+rz", **changes)


def gamma(n: int, unit: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: worst-case relative error of n roundings."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n * unit >= 1:
        raise ValueError(f"gamma_n needs n*u < 1, got n={n}, u={unit}")
    return n * unit / (1 - n * unit)


def gamma_probabilistic(n: int, lam: float, unit: float) -> float:
    """Higham & Mary (2019, Theorem 2.4): ``exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1``; bounds n
    independent mean-zero roundings with probability >= ``1 - 2 exp(-lam^2 (1-u)^2 / 2)``."""
    if n < 0 or lam <= 0:
        raise ValueError(f"need n >= 0 and lam > 0, got n={n}, lam={lam}")
    return math.expm1(lam * math.sqrt(n) * unit + n * unit * unit / (1 - unit))


def hoeffding_lambda(events: int, failure_probability: float) -> float:
    """The ``lam`` for which ``events`` Hoeffding bounds ``|sum e_s| <= lam sqrt(sum b_s^2)``
    (independent mean-zero ``|e_s| <= b_s``) all hold with probability >= 1 - failure_probability
    (each fails with probability <= ``2 exp(-lam^2 / 2)``; union bound)."""
    if not 0 < failure_probability < 1:
        raise ValueError(f"failure_probability must lie in (0, 1), got {failure_probability}")
    return math.sqrt(2 * math.log(2 * max(events, 1) / failure_probability))
