"""The fuzzers' two tolerances.

Against the float64 oracle every fuzzer asks the one accuracy judge, :func:`magi_moe.audit.
judge.judge`, with a false-alarm probability of ``CAMPAIGN_FAILURE_PROBABILITY`` per case for
its probabilistic bounds: small enough for campaigns of millions of cases.

Within rounding (equivariance, linearity, :func:`rounding_mismatch`): two results of the same
exact value whose fp32 accumulation order may differ can be a couple of output ulps apart. Where
the top-k sum cancels, a changed order moves the result by far more than that, up to the
audited worst-case bound of each result: :func:`order_mismatch` allows that too, so that the
locality checks, which compare two calls, never report a kernel whose sum order changes from call
to call (the determinism clause's finding, and only its).
"""
from __future__ import annotations

import torch

from magi_moe.judge.precision import unit_roundoff

__all__ = ["CAMPAIGN_FAILURE_PROBABILITY", "order_mismatch", "rounding_mismatch"]

CAMPAIGN_FAILURE_PROBABILITY = 1e-9


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


def order_mismatch(a: torch.Tensor, b: torch.Tensor, slack, *, out_dtype: torch.dtype,
                   accumulate_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`rounding_mismatch`, except where ``|a - b|`` is within ``slack``: the sum of the
    two results' worst-case error bounds (``magi_moe.judge.bounds``), which any summation order keeps
    each result inside. ``slack``: a tensor, or a function returning it (called only when some
    element is beyond rounding: the bounds cost more than the comparison). NaN still mismatches."""
    bad = rounding_mismatch(a, b, out_dtype=out_dtype, accumulate_dtype=accumulate_dtype)
    if not bool(bad.any()):
        return bad
    slack = slack() if callable(slack) else slack
    near = (a.double() - b.double()).abs() <= slack.to(device=a.device, dtype=torch.float64)
    return bad & ~near
