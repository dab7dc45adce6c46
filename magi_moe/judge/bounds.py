"""Proven error bounds for the expert computation, per output element (CONTRACT section 1).

For one route ``r`` (token ``s``, head ``h``, bank ``f``, routing weight ``p``) and output
column ``j < Dh``, with every input taken as its exact (bf16-valued) number:

    g = x W_gate[f],  u = x W_up[f]                     (sums over Dh)
    a = SwiGLU7(g, u) = f(g) v(u),  f(g) = m sigmoid(1.702 m), m = min(g, 7),
                                    v(u) = clamp(u, -7, 7) + 1
    o_j = sum_i a_i W_down[f][i, j]                     (sum over I)
    y_j = sum over the token's K routes of p o_j

A :class:`~magi_moe.judge.precision.PrecisionModel` says where an implementation rounds. Each step is
bounded with the standard model (``|fl(v) - v| <= unit |v| + underflow``) and each sum of n
exact products with ``gamma_{n+1} sum |terms|`` (Higham Lemma 3.1; the +1 covers operands whose
products are not exact in the accumulator). Errors cross SwiGLU7 through its derivatives:
``|f(g') - f(g)| <= L |g' - g|`` with ``L = min(F1_MAX, |f'(m)| + F2_MAX |g' - g|)``, and
``|v(u') - v(u)| <= |u' - u|``. The fp32 evaluation of SwiGLU7 itself is allowed
``(EVAL_OPS + EVAL_ARG * 1.702 |g|) u_fp32`` relative error (about nine roundings, plus exp's
sensitivity to its argument) and an absolute ``EVAL_UNDERFLOW`` (sigmoid underflows for g < -52).

Two bounds per element:

* worst case: every rounding at its extreme. Must never be exceeded; a violation proves the
  implementation does not follow its declared model.
* probabilistic (Higham & Mary, "A new approach to probabilistic rounding error analysis",
  SISC 2019): rounding errors independent and mean zero. The per-term errors of the SwiGLU7
  output (one per (route, i)) and the per-route roundings are independent sources ``e_s`` with
  ``|e_s| <= b_s``; Hoeffding gives ``|sum e_s| <= lam sqrt(sum b_s^2)`` -- of order
  ``lam sqrt(n) u`` against the worst case's ``n u`` -- and the fp32 accumulations use
  ``gamma~_n(lam)``. ``lam`` is chosen so that all elements' bounds hold together with
  probability >= ``1 - failure_probability``. Exceeding it flags real precision loss (bf16
  accumulation, rounding before SwiGLU7) with that false-alarm probability.

The reference value is recomputed here in float64 (the same formula as
``magi_moe.reference.expert_reference``); its own float64 error, bounded with the ``float64``
model, is added to both bounds.

Everything is vectorised in float64 over the routes of one bank, then summed per output with
``index_add_``; the loop runs over banks. ``audit.mpcheck`` validates these formulas with mpmath.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import torch

from magi_moe.config import MoEConfig
from magi_moe.problems import Problem
from magi_moe.reference import SWIGLU_ALPHA, SWIGLU_LIMIT
from magi_moe.registry import Implementation
from magi_moe.routing import RouteTable
from magi_moe.weights import ExpertWeights

from .precision import (PrecisionModel, gamma, gamma_probabilistic, hoeffding_lambda,
                        precision_model)

# max |f'| and max |f''| over all g for f(g) = g sigmoid(1.702 g): f'(g) = silu'(1.702 g) peaks
# at 1.0998; f''(g) = 1.702 silu''(1.702 g) peaks at 1.702 / 2. Checked in audit.mpcheck.
F1_MAX = 1.1
F2_MAX = 0.852
EVAL_OPS = 16
EVAL_ARG = 4
EVAL_UNDERFLOW = 2.0 ** -100
DEFAULT_FAILURE_PROBABILITY = 1e-4

MODEL_FLOAT64 = precision_model("float64")


@dataclass
class ErrorBounds:
    """Per-element bounds on ``|out - reference|`` for one problem and one precision model.

    ``reference``, ``worst``, ``probabilistic``: float64 ``[S, H*Dh]`` on the problem's device.
    ``lam``: Hoeffding's lambda; ``lam_accumulate``: the lambda of the ``gamma~_n`` terms.
    """

    model: PrecisionModel
    reference: torch.Tensor
    worst: torch.Tensor
    probabilistic: torch.Tensor
    lam: float
    lam_accumulate: float
    failure_probability: float
    num_routes: int


@dataclass
class _Bank:
    """Model-independent terms for the ``n`` routes of one bank (float64)."""

    g: torch.Tensor          # [n, I]
    u: torch.Tensor          # [n, I]
    g_abs_sum: torch.Tensor  # [n, I]  sum_d |x_d| |W_gate[d, i]|
    u_abs_sum: torch.Tensor  # [n, I]
    f: torch.Tensor          # [n, I]  f(g) = m sigmoid(1.702 m)
    f_prime: torch.Tensor    # [n, I]  f'(m)
    v: torch.Tensor          # [n, I]  clamp(u) + 1
    a: torch.Tensor          # [n, I]
    o: torch.Tensor          # [n, Dh]
    a_abs_w: torch.Tensor    # [n, Dh] sum_i |a_i| |W_down[i, j]|
    w_down_abs: torch.Tensor  # [I, Dh]
    w_down_sq: torch.Tensor  # [I, Dh]


def _bank_terms(xs: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor) -> _Bank:
    g, u = xs @ w_gate, xs @ w_up
    xs_abs = xs.abs()
    m = g.clamp(max=SWIGLU_LIMIT)
    sig = torch.sigmoid(SWIGLU_ALPHA * m)
    f = m * sig
    v = u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT) + 1
    a = f * v
    w_down_abs = w_down.abs()
    return _Bank(
        g=g, u=u, g_abs_sum=xs_abs @ w_gate.abs(), u_abs_sum=xs_abs @ w_up.abs(), f=f,
        f_prime=sig * (1 + SWIGLU_ALPHA * m * (1 - sig)), v=v, a=a, o=a @ w_down,
        a_abs_w=a.abs() @ w_down_abs, w_down_abs=w_down_abs, w_down_sq=w_down * w_down)


def _activation_error(t: _Bank, model: PrecisionModel, head_dim: int) -> torch.Tensor:
    """Bound on ``|a_hat_i - a_i|`` per (route, i): the down projection's operand error."""
    acc_u, acc_eta = model.accumulate_unit, model.accumulate.underflow
    gam = gamma(head_dim + 1, acc_u)
    eg = gam * t.g_abs_sum + head_dim * acc_eta
    eu = gam * t.u_abs_sum + head_dim * acc_eta
    if model.round_gate_up is not None:
        eg = eg + model.round_gate_up.rounding_error(t.g.abs() + eg)
        eu = eu + model.round_gate_up.rounding_error(t.u.abs() + eu)
    lipschitz = (t.f_prime.abs() + F2_MAX * eg).clamp(max=F1_MAX)
    v_hat = (t.v.abs() + eu).clamp(max=SWIGLU_LIMIT + 1)
    propagated = lipschitz * eg * v_hat + t.f.abs() * eu
    magnitude = t.a.abs() + propagated
    z = SWIGLU_ALPHA * (t.g.abs() + eg)
    evaluation = (EVAL_OPS + EVAL_ARG * z) * model.evaluate.unit * magnitude + EVAL_UNDERFLOW
    err = propagated + evaluation
    if model.round_activation is not None:
        err = err + model.round_activation.rounding_error(magnitude + evaluation)
    return err


@dataclass
class _RouteTerms:
    err_worst: torch.Tensor   # [n, Dh] bound on |c_hat - c|
    magnitude: torch.Tensor   # [n, Dh] |c_hat| <= magnitude
    sources_sq: torch.Tensor  # [n, Dh] sum of squared independent source bounds
    det_prob: torch.Tensor    # [n, Dh] non-averaging part of the probabilistic bound


def _route_terms(t: _Bank, p: torch.Tensor, model: PrecisionModel, lam_acc: float,
                 head_dim: int, inter: int) -> _RouteTerms:
    acc_u, acc_eta = model.accumulate_unit, model.accumulate.underflow
    da = _activation_error(t, model, head_dim)
    s1 = da @ t.w_down_abs                  # worst: sum_i da_i |W_ij|
    sources = (da * da) @ t.w_down_sq       # Hoeffding: sum_i (da_i W_ij)^2
    a_hat_w = t.a_abs_w + s1                # sum_i |a_hat_i| |W_ij|
    acc_worst = gamma(inter + 1, acc_u) * a_hat_w + inter * acc_eta
    acc_prob = gamma_probabilistic(inter + 1, lam_acc, acc_u) * a_hat_w + inter * acc_eta
    e_o = s1 + acc_worst
    o_abs = t.o.abs()
    if model.round_down is not None:
        rounding = model.round_down.rounding_error(o_abs + e_o)
        e_o = e_o + rounding
        sources = sources + rounding * rounding
    pa = p.abs()[:, None]
    product = model.evaluate.rounding_error(pa * (o_abs + e_o))  # fl(p * o_hat)
    e_c = pa * e_o + product
    det = pa * acc_prob + product
    sources = sources * (pa * pa)
    c_abs = pa * o_abs
    if model.round_route is not None:
        rounding = model.round_route.rounding_error(c_abs + e_c)
        e_c = e_c + rounding
        sources = sources + rounding * rounding
    return _RouteTerms(err_worst=e_c, magnitude=c_abs + e_c, sources_sq=sources, det_prob=det)


def _source_gain(model: PrecisionModel, top_k: int) -> float:
    """Factor by which the roundings after the down projection can enlarge an earlier error."""
    gain = (1 + model.evaluate.unit) * (1 + gamma(top_k, model.accumulate_unit))
    for fmt in (model.round_down, model.round_route):
        if fmt is not None:
            gain *= 1 + fmt.unit
    return gain


@torch.no_grad()  # routes taken from a live layer may carry autograd history
def compute_error_bounds(
    x: torch.Tensor,
    table: RouteTable,
    weights: ExpertWeights,
    config: MoEConfig,
    models: Iterable[PrecisionModel | str],
    *,
    failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
) -> dict[str, ErrorBounds]:
    """Bounds for several precision models at once (they share the float64 matmuls).

    ``x`` ``[S, H*Dh]``; returns ``{model.name: ErrorBounds}``."""
    models = [precision_model(m, x.dtype) for m in models]
    if not models:
        raise ValueError("models must name at least one precision model")
    S, H, Dh = table.num_tokens, config.num_heads, config.head_dim
    E, I, K = config.num_experts, config.intermediate_size, config.top_k
    weights.check(config)
    if x.shape != (S, config.hidden_size):
        raise ValueError(f"x must have shape [{S}, {config.hidden_size}], got {tuple(x.shape)}")
    elements = S * H * Dh
    # Half the failure budget to the per-element Hoeffding bounds, half to the gamma~ terms
    # (one per down-projection inner product and top-k sum: K (I + 2) per element).
    lam = hoeffding_lambda(elements, failure_probability / 2)
    lam_acc = {m.name: hoeffding_lambda(elements * K * (I + 2), failure_probability / 2)
               / (1 - m.accumulate_unit) for m in models}
    all_models = models + ([MODEL_FLOAT64] if all(m.name != "float64" for m in models) else [])

    device = x.device
    f64 = torch.float64
    R = table.num_routes
    # Per-route rows in CSR order, summed per output once at the end (one index_add_ each).
    route_y = torch.zeros(R, Dh, dtype=f64, device=device)
    rows = {m.name: {k: torch.zeros(R, Dh, dtype=f64, device=device)
                     for k in ("err", "mag", "src", "det")} for m in all_models}
    xw = x.to(f64).view(S, H, Dh)
    offsets = table.offsets.tolist()
    for bank in range(config.num_banks):
        lo, hi = offsets[bank], offsets[bank + 1]
        if lo == hi:
            continue
        h = bank // E
        tokens = table.gather_ids[lo:hi].long()
        t = _bank_terms(xw[tokens, h], weights.w_gate[bank].to(f64), weights.w_up[bank].to(f64),
                        weights.w_down[bank].to(f64))
        p = table.sorted_probs[lo:hi].to(f64)
        route_y[lo:hi] = t.o * p[:, None]
        for m in all_models:
            terms = _route_terms(t, p, m, lam_acc.get(m.name, lam), Dh, I)
            out = rows[m.name]
            out["err"][lo:hi] = terms.err_worst
            out["mag"][lo:hi] = terms.magnitude
            out["src"][lo:hi] = terms.sources_sq
            out["det"][lo:hi] = terms.det_prob

    heads = torch.repeat_interleave(torch.arange(config.num_banks, device=device) // E,
                                    table.counts(), output_size=R)
    target = table.gather_ids.long() * H + heads

    def per_output(route_rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(S * H, Dh, dtype=f64, device=device).index_add_(0, target, route_rows)

    y = per_output(route_y)
    sums = {name: {k: per_output(v) for k, v in quantities.items()}
            for name, quantities in rows.items()}
    y_abs = y.abs()

    def finish(m: PrecisionModel) -> tuple[torch.Tensor, torch.Tensor]:
        acc = sums[m.name]
        acc_eta = m.accumulate.underflow
        e_y = acc["err"] + gamma(K, m.accumulate_unit) * acc["mag"] + K * acc_eta
        out_round = (m.round_output.rounding_error(y_abs + e_y) if m.round_output is not None
                     else torch.zeros_like(e_y))
        worst = e_y + out_round
        la = lam_acc.get(m.name, lam)
        prob = (lam * _source_gain(m, K) * acc["src"].sqrt() + _source_gain(m, K) * acc["det"]
                + gamma_probabilistic(K, la, m.accumulate_unit) * acc["mag"] + K * acc_eta
                + out_round)
        return worst, torch.minimum(prob, worst)

    reference_error, _ = finish(MODEL_FLOAT64)
    result = {}
    for m in models:
        worst, prob = finish(m)
        result[m.name] = ErrorBounds(
            model=m, reference=y.view(S, H * Dh),
            worst=(worst + reference_error).view(S, H * Dh),
            probabilistic=(prob + reference_error).view(S, H * Dh),
            lam=lam, lam_accumulate=lam_acc[m.name], failure_probability=failure_probability,
            num_routes=table.num_routes)
    return result


def problem_bounds(problem: Problem, model: PrecisionModel | str | Implementation, *,
                   failure_probability: float = DEFAULT_FAILURE_PROBABILITY) -> ErrorBounds:
    """:func:`compute_error_bounds` for one problem and model, cached per problem object."""
    if isinstance(model, Implementation):
        model = model.precision
    model = precision_model(model, problem.x.dtype)
    key = (id(problem), model, failure_probability)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is problem:
        return hit[1]
    bounds = compute_error_bounds(problem.x, problem.table, problem.weights, problem.config,
                                  [model], failure_probability=failure_probability)[model.name]
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (weakref.ref(problem), bounds)
    return bounds


_CACHE: dict = {}
_CACHE_SIZE = 8

QUANTILES = (0.5, 0.9, 0.99, 0.999)
HIST_EDGES = [10.0 ** (k / 4) for k in range(-32, 5)]  # 1e-8 .. 10, four bins per decade
SAMPLE_SIZE = 20_000


@dataclass
class BoundReport:
    """How one output compares with its bounds. ``ok``: no element exceeds either bound and
    every element is finite. Ratios are ``|out - reference| / bound`` per element."""

    label: str
    model: str
    lam: float
    elements: int
    worst_max_ratio: float
    prob_max_ratio: float
    worst_violations: int
    prob_violations: int
    nonfinite: int
    worst_quantiles: dict[str, float]
    prob_quantiles: dict[str, float]
    hist_edges: list[float]
    worst_hist: list[int]
    prob_hist: list[int]
    relative_l2: float
    max_abs_error: float
    worst_element: tuple[int, int]
    sample: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def proven_ok(self) -> bool:
        """No element exceeds the worst-case bound (and all are finite)."""
        return self.worst_violations == 0 and self.nonfinite == 0

    @property
    def ok(self) -> bool:
        return self.proven_ok and self.prob_violations == 0

    @property
    def max_ratio(self) -> float:
        """Largest observed error over the probabilistic bound (the tight one)."""
        return self.prob_max_ratio

    def summary(self) -> str:
        verdict = "ok" if self.ok else ("PRECISION LOSS" if self.proven_ok else "BOUND VIOLATED")
        s, c = self.worst_element
        return (f"{self.label or 'output'} [{self.model}]: max err/bound worst-case "
                f"{self.worst_max_ratio:.3g}, probabilistic {self.prob_max_ratio:.3g} "
                f"(lam={self.lam:.2f}); violations {self.worst_violations} worst-case, "
                f"{self.prob_violations} probabilistic, {self.nonfinite} non-finite of "
                f"{self.elements}; rel L2 {self.relative_l2:.3g}, max abs {self.max_abs_error:.3g} "
                f"at (token {s}, column {c}) -> {verdict}")

    def to_dict(self, *, with_sample: bool = False) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "sample"}
        d.update(ok=self.ok, proven_ok=self.proven_ok)
        if with_sample:
            d["sample"] = self.sample
        return d


def _quantiles(ratio: torch.Tensor) -> dict[str, float]:
    flat = ratio.flatten()
    if flat.numel() > 4_000_000:  # sort a fixed random subsample; the max is taken exactly
        idx = torch.randint(flat.numel(), (4_000_000,), generator=torch.Generator().manual_seed(0))
        flat = flat[idx.to(flat.device)]
    ordered = flat.sort().values
    n = ordered.numel()
    return {f"p{q * 100:g}": float(ordered[min(n - 1, int(q * n))]) for q in QUANTILES}


def _histogram(ratio: torch.Tensor) -> list[int]:
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64, device=ratio.device)
    clipped = ratio.flatten().clamp(min=HIST_EDGES[0], max=HIST_EDGES[-1] * 0.999)
    bins = torch.bucketize(clipped, edges, right=True) - 1
    return torch.bincount(bins.clamp(0, len(HIST_EDGES) - 2),
                          minlength=len(HIST_EDGES) - 1).tolist()


def evaluate_bounds(out: torch.Tensor, bounds: ErrorBounds, *, label: str = "") -> BoundReport:
    """Compare an implementation's output ``[S, H*Dh]`` with precomputed bounds."""
    ref = bounds.reference
    if out.shape != ref.shape:
        raise ValueError(f"out must have shape {tuple(ref.shape)}, got {tuple(out.shape)}")
    err = (out.to(device=ref.device, dtype=torch.float64) - ref).abs()
    finite = torch.isfinite(err)
    nonfinite = int((~finite).sum())
    err_f = torch.where(finite, err, torch.zeros_like(err))
    ratio_w = err_f / bounds.worst
    ratio_p = err_f / bounds.probabilistic
    n = err.numel()
    flat_arg = int(torch.argmax(torch.where(finite, ratio_p, torch.full_like(ratio_p, math.inf)))) if n else 0
    ref_norm = float(ref.norm())
    diff_norm = float(err_f.norm()) if nonfinite == 0 else math.inf
    gen = torch.Generator().manual_seed(1)
    pick = (torch.randperm(n, generator=gen) if n <= SAMPLE_SIZE else
            torch.randint(n, (SAMPLE_SIZE,), generator=gen)).to(err.device)
    return BoundReport(
        label=label,
        model=bounds.model.name,
        lam=bounds.lam,
        elements=n,
        worst_max_ratio=float(ratio_w.max()) if n else 0.0,
        prob_max_ratio=float(ratio_p.max()) if n else 0.0,
        worst_violations=int((ratio_w > 1).sum()),
        prob_violations=int((ratio_p > 1).sum()),
        nonfinite=nonfinite,
        worst_quantiles=_quantiles(ratio_w) if n else {},
        prob_quantiles=_quantiles(ratio_p) if n else {},
        hist_edges=list(HIST_EDGES),
        worst_hist=_histogram(ratio_w) if n else [],
        prob_hist=_histogram(ratio_p) if n else [],
        relative_l2=diff_norm / ref_norm if ref_norm > 0 else diff_norm,
        max_abs_error=float(err_f.max()) if n else 0.0,
        worst_element=divmod(flat_arg, ref.shape[1]) if n else (0, 0),
        sample={"error": err_f.flatten()[pick].tolist(),
                "worst": bounds.worst.flatten()[pick].tolist(),
                "probabilistic": bounds.probabilistic.flatten()[pick].tolist()},
    )


def check_error_bounds(out: torch.Tensor, problem: Problem,
                       precision_model: PrecisionModel | str | Implementation, *,
                       failure_probability: float = DEFAULT_FAILURE_PROBABILITY,
                       label: str = "") -> BoundReport:
    """The bounds criterion alone (tests judge with :func:`magi_moe.judge.judge`, which applies it
    first): bounds for ``problem`` under ``precision_model`` (a model, its name, or an
    Implementation, whose declared model is used), then ``out`` checked against them. Use
    ``report.ok`` (both bounds) or ``report.proven_ok`` (worst case only)."""
    if isinstance(precision_model, Implementation):
        label = label or precision_model.name
    bounds = problem_bounds(problem, precision_model, failure_probability=failure_probability)
    return evaluate_bounds(out, bounds, label=label)
