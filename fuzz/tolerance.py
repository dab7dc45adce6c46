"""How close is close enough: the differential criterion and "equal within rounding".

Differential (:func:`judge`): against the float64 oracle on the same routes.

* With the auditor present (``audit.bounds``), its per-element bounds for the implementation's
  declared precision model: no element may exceed the proven worst-case bound or the
  probabilistic one (at a false-alarm probability of ``AUDIT_FAILURE_PROBABILITY`` per case, small
  enough for campaigns of millions of cases). The error ratio is the largest error/bound over
  the elements (probabilistic bound).
* Without it (fuzz runs on its own), the FlashAttention-style criterion
  (:func:`differential_report`): at most twice as wrong as the plain PyTorch baseline at working
  precision (``torch-bf16``), plus a noise floor of two unit roundoffs of the output dtype (the
  one final rounding alone costs up to one), for both the relative L2 error and the largest
  elementwise error; the error ratio is the larger of the two error/bound ratios.

The fuzzers push the error ratio up with ``hypothesis.target``.

Within rounding (equivariance, linearity on non-deterministic paths): two results of the same
exact value whose fp32 accumulation order may differ can be a couple of output ulps apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["AUDIT_FAILURE_PROBABILITY", "ErrorReport", "Verdict", "differential_report", "judge",
           "rounding_mismatch", "unit_roundoff"]

AUDIT_FAILURE_PROBABILITY = 1e-9

_UNIT_ROUNDOFF = {
    torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-53,
}


def unit_roundoff(dtype: torch.dtype) -> float:
    try:
        return _UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {list(_UNIT_ROUNDOFF)}, got {dtype}") from None


@dataclass(frozen=True)
class ErrorReport:
    rel_l2: float
    max_abs: float
    baseline_rel_l2: float
    baseline_max_abs: float
    bound_rel_l2: float
    bound_max_abs: float
    ratio: float           # max(rel_l2 / bound_rel_l2, max_abs / bound_max_abs)
    worst_index: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"rel L2 {self.rel_l2:.3e} (bound {self.bound_rel_l2:.3e}, baseline {self.baseline_rel_l2:.3e}); "
                f"max abs {self.max_abs:.3e} at {list(self.worst_index)} (bound {self.bound_max_abs:.3e}, "
                f"baseline {self.baseline_max_abs:.3e}); ratio {self.ratio:.3f}")


def _ratio(err: float, bound: float) -> float:
    if bound > 0:
        return err / bound
    return 0.0 if err == 0 else float("inf")


def differential_report(out: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                        out_dtype: torch.dtype) -> ErrorReport:
    """Compare ``out`` with the float64 ``reference``, bounded by the ``baseline``'s own error.
    All three have the same shape; NaN or inf in ``out`` gives an infinite ratio."""
    ref = reference.double()
    diff = (out.double() - ref).abs()
    base_diff = (baseline.double() - ref).abs()
    ref_norm = float(ref.norm())
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    u = unit_roundoff(out_dtype)
    norm = ref_norm if ref_norm > 0 else 1.0
    if not bool(torch.isfinite(diff).all()):
        bad = (~torch.isfinite(diff)).nonzero()[0].tolist()
        inf = float("inf")
        return ErrorReport(inf, inf, float(base_diff.norm()) / norm, float(base_diff.max()),
                           0.0, 0.0, inf, tuple(bad))
    rel = float(diff.norm()) / norm
    base_rel = float(base_diff.norm()) / norm
    max_abs = float(diff.max()) if diff.numel() else 0.0
    base_max = float(base_diff.max()) if base_diff.numel() else 0.0
    bound_rel = 2 * base_rel + 2 * u
    bound_abs = 2 * base_max + 2 * u * ref_max
    worst = tuple(torch.nonzero(diff == diff.max())[0].tolist()) if diff.numel() else ()
    return ErrorReport(rel, max_abs, base_rel, base_max, bound_rel, bound_abs,
                       max(_ratio(rel, bound_rel), _ratio(max_abs, bound_abs)), worst)


def rounding_mismatch(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype,
                      accumulate_dtype: torch.dtype = torch.float32, ulps: float = 2.0) -> torch.Tensor:
    """Boolean mask of elements where ``a`` and ``b`` differ by more than ``ulps`` output ulps
    (relative to the larger of the two) plus an accumulation-order slack of ``2^10`` unit roundoffs
    of ``accumulate_dtype`` relative to the largest magnitude present. NaN anywhere mismatches."""
    a64, b64 = a.double(), b.double()
    mag = torch.maximum(a64.abs(), b64.abs())
    scale = float(mag.max()) if mag.numel() else 0.0
    tol = ulps * 2 * unit_roundoff(out_dtype) * mag + 2.0**10 * unit_roundoff(accumulate_dtype) * scale
    close = (a64 - b64).abs() <= tol
    return ~close | torch.isnan(a64) | torch.isnan(b64)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    ratio: float
    text: str
    source: str        # "audit.bounds" or "flashattention"
    metrics: dict


def judge(out: torch.Tensor, problem, precision, reference: torch.Tensor, baseline: torch.Tensor) -> Verdict:
    """The differential verdict for ``out`` on ``problem``: the auditor's bounds for ``precision``
    (an Implementation or a precision-model name) when ``audit.bounds`` can be imported and knows
    the model, else the FlashAttention-style criterion against ``reference`` and ``baseline``."""
    try:
        from magi_moe.audit.bounds import check_error_bounds
    except ImportError:
        check_error_bounds = None
    if check_error_bounds is not None:
        try:
            report = check_error_bounds(out, problem, precision,
                                        failure_probability=AUDIT_FAILURE_PROBABILITY)
        except (ValueError, KeyError) as exc:  # a precision model the auditor does not know
            fallback = f" (audit.bounds declined: {exc})"
        else:
            metrics = {k: v for k, v in report.to_dict().items()
                       if not k.endswith("hist") and k != "hist_edges"}
            return Verdict(report.ok, report.prob_max_ratio, report.summary(), "audit.bounds", metrics)
    else:
        fallback = ""
    fa = differential_report(out, reference, baseline, out.dtype)
    return Verdict(fa.ok, fa.ratio, fa.describe() + fallback, "flashattention", fa.as_dict())
