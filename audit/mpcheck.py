"""The bounds of :mod:`magi_moe.judge.bounds` checked with mpmath (arbitrary precision), on tiny shapes.

Three kinds of check, each returning :class:`Check` rows for the report:

* ``check_constants()``: gamma_n and gamma~_n(lam) against mpmath; SwiGLU7's derivative bounds
  ``F1_MAX`` / ``F2_MAX`` against the true extrema (found by root-finding at 256 bits); the
  Lipschitz step the bounds use, on random pairs; the closed form of f' against numerical
  differentiation; and the fp32 SwiGLU7 evaluation allowance, by evaluating the kernel's op
  sequence with every op rounded to fp32 (and exp perturbed by up to 2 ulps, as a fast GPU exp).
* ``check_formula(problem, model)``: the vectorised float64 worst-case bound against the same
  formula evaluated element by element in mpmath from the route list (not the CSR table).
* ``check_simulation(problem, model)``: the model's whole rounding chain simulated exactly
  (every sum in a random order, every operation rounded to its format, accumulators rounding to
  nearest or truncating), its true error against the exact value, which must lie under the
  worst-case bound; and the float64 reference's own error under its ``float64`` bound.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

import mpmath
import torch

from magi_moe.config import MoEConfig
from magi_moe.problems import Problem
from magi_moe.reference import SWIGLU_ALPHA, SWIGLU_LIMIT

from magi_moe.judge.bounds import (EVAL_ARG, EVAL_OPS, EVAL_UNDERFLOW, F1_MAX, F2_MAX, MODEL_FLOAT64,
                     compute_error_bounds)
from magi_moe.judge.precision import (FP32, FloatFormat, PrecisionModel, gamma, gamma_probabilistic,
                        precision_model, with_truncating_downcasts)
from .probes import probe_problem

PREC = 256  # bits: sums of products of bf16 numbers over the tiny shapes here are exact
ALPHA = mpmath.mpf("1.702")
LIMIT = mpmath.mpf(SWIGLU_LIMIT)

# Small enough that every element is simulated exactly in about a second.
TINY = MoEConfig(num_heads=2, head_dim=16, num_experts=3, top_k=2, intermediate_size=16,
                 route_scale=2.5)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# -- exact rounding --------------------------------------------------------------------------

def mp_round(x, fmt: FloatFormat, mode: str = "nearest"):
    """``x`` rounded to ``fmt`` (gradual underflow, no overflow): to nearest with ties to even,
    or toward zero (``mode="truncate"``)."""
    x = mpmath.mpf(x)
    if x == 0:
        return x
    _, exp = mpmath.frexp(x)                  # |x| in [2^(exp-1), 2^exp)
    quantum = max(exp - 1, fmt.emin) - fmt.bits + 1
    scaled = mpmath.ldexp(x, -quantum)
    if mode == "nearest":
        r = mpmath.nint(scaled)
    elif mode == "truncate":
        r = mpmath.floor(scaled) if scaled > 0 else mpmath.ceil(scaled)
    else:
        raise ValueError(f"mode must be 'nearest' or 'truncate', got {mode!r}")
    return mpmath.ldexp(r, quantum)


def _ulp(x, fmt: FloatFormat):
    _, exp = mpmath.frexp(x) if x != 0 else (0, fmt.emin)
    return mpmath.ldexp(1, max(exp - 1, fmt.emin) - fmt.bits + 1)


# -- SwiGLU7 pieces --------------------------------------------------------------------------

def _f(g):
    m = min(g, LIMIT)
    return m / (1 + mpmath.exp(-ALPHA * m))


def _f_prime(g):
    m = min(g, LIMIT)
    s = 1 / (1 + mpmath.exp(-ALPHA * m))
    return s * (1 + ALPHA * m * (1 - s))


def _swiglu_exact(g, u):
    return _f(g) * (max(min(u, LIMIT), -LIMIT) + 1)


def swiglu_fp32_sequence(g, u, fmt: FloatFormat = FP32, exp_ulps: int = 0):
    """SwiGLU7 as the kernels evaluate it, every operation rounded to ``fmt``; exp is off by
    ``exp_ulps`` ulps (a faithful but not correctly rounded exp)."""
    r = lambda v: mp_round(v, fmt)  # noqa: E731
    alpha = r(ALPHA)
    m = min(g, LIMIT)
    z = r(alpha * m)
    e = r(mpmath.exp(-z))
    e = e + exp_ulps * _ulp(e, fmt) if e != 0 else e
    s = r(1 / r(1 + e))
    return r(r(m * s) * r(max(min(u, LIMIT), -LIMIT) + 1))


def check_constants(seed: int = 0) -> list[Check]:
    checks = []
    with mpmath.workprec(PREC):
        # gamma formulas
        worst = 0.0
        for n, u in ((1, 2.0 ** -8), (257, 2.0 ** -23), (1281, 2.0 ** -24), (1000, 2.0 ** -53)):
            exact = mpmath.mpf(n) * u / (1 - mpmath.mpf(n) * u)
            worst = max(worst, float(abs(gamma(n, u) - exact) / exact))
            for lam in (1.0, 6.5):
                nu = mpmath.mpf(n)
                exact_p = mpmath.expm1(lam * mpmath.sqrt(nu) * u + nu * u * u / (1 - mpmath.mpf(u)))
                worst = max(worst, float(abs(gamma_probabilistic(n, lam, u) - exact_p) / exact_p))
        checks.append(Check("gamma_n and gamma~_n(lam) formulas", worst < 1e-12,
                            f"max relative difference from mpmath {worst:.2e}"))

        # derivative extrema of f(g) = g sigmoid(1.702 g)
        fp = lambda g: _f_prime(g)  # noqa: E731
        fpp = lambda g: mpmath.diff(fp, g)  # noqa: E731
        crit = [mpmath.findroot(fpp, g0) for g0 in (1.4, -1.4)]
        f1 = max(abs(fp(g)) for g in crit + [mpmath.mpf(0), LIMIT - mpmath.mpf("1e-30")])
        grid = [mpmath.mpf(k) / 50 for k in range(-2000, 350)]
        f1_grid = max(abs(fp(g)) for g in grid)
        checks.append(Check("F1_MAX >= max |f'|", F1_MAX >= max(f1, f1_grid),
                            f"max |f'| = {float(max(f1, f1_grid)):.6f} <= F1_MAX = {F1_MAX}"))
        f2_at0 = abs(fpp(mpmath.mpf(0)))
        f2_grid = max(abs(fpp(g)) for g in grid[::5])
        checks.append(Check("F2_MAX >= max |f''|", F2_MAX >= max(f2_at0, f2_grid),
                            f"max |f''| = {float(max(f2_at0, f2_grid)):.6f} <= F2_MAX = {F2_MAX}"))
        closed = max(abs(_f_prime(g) - mpmath.diff(_f, g)) for g in
                     (mpmath.mpf(v) for v in (-9.3, -2, -0.4, 0.3, 1.41, 3, 6.9)))
        checks.append(Check("closed form of f'", closed < 1e-30,
                            f"max |f'(closed) - numerical f'| = {float(closed):.1e}"))

        # The Lipschitz step: |f(g2) - f(g1)| <= min(F1, |f'(min(g1,7))| + F2 |d|) |d|
        rng = random.Random(seed)
        worst_ratio = 0.0
        for _ in range(400):
            g1 = mpmath.mpf(rng.uniform(-12, 10))
            d = mpmath.mpf(rng.choice((1e-6, 1e-3, 0.05, 0.5, 2.0)) * rng.uniform(-1, 1))
            bound = min(F1_MAX, abs(_f_prime(g1)) + F2_MAX * abs(d)) * abs(d)
            if bound:
                worst_ratio = max(worst_ratio, float(abs(_f(g1 + d) - _f(g1)) / bound))
        checks.append(Check("SwiGLU7 Lipschitz step", worst_ratio <= 1.0,
                            f"max |f(g+d) - f(g)| / bound = {worst_ratio:.6f} over 400 pairs"))

        # fp32 evaluation allowance
        worst_ratio = 0.0
        for _ in range(400):
            g = mp_round(rng.choice((rng.gauss(0, 2), rng.uniform(-60, 10), rng.uniform(6.5, 7.5))), FP32)
            u = mp_round(rng.choice((rng.gauss(0, 2), rng.uniform(-1.01, -0.99), rng.uniform(-8, 8))), FP32)
            exact = _swiglu_exact(g, u)
            got = swiglu_fp32_sequence(g, u, exp_ulps=rng.randint(-2, 2))
            allowed = (EVAL_OPS + EVAL_ARG * SWIGLU_ALPHA * abs(g)) * FP32.unit * abs(exact) + EVAL_UNDERFLOW
            worst_ratio = max(worst_ratio, float(abs(got - exact) / allowed))
        checks.append(Check("fp32 SwiGLU7 evaluation allowance", worst_ratio <= 1.0,
                            f"max error / allowance = {worst_ratio:.3f} over 400 points "
                            f"(exp off by up to 2 ulps)"))
    return checks


# -- the problem as plain numbers ------------------------------------------------------------

@dataclass
class _Route:
    token: int
    head: int
    bank: int
    prob: object  # mpf


def _routes(problem: Problem) -> list[_Route]:
    t, E = problem.table, problem.config.num_experts
    offsets = t.offsets.tolist()
    ids, probs = t.gather_ids.tolist(), t.sorted_probs.double().tolist()
    return [_Route(ids[r], f // E, f, mpmath.mpf(probs[r]))
            for f in range(problem.config.num_banks) for r in range(offsets[f], offsets[f + 1])]


def _mp_matrix(t: torch.Tensor) -> list[list]:
    return [[mpmath.mpf(v) for v in row] for row in t.double().tolist()]


class _Numbers:
    """The problem's inputs as exact mpf values."""

    def __init__(self, problem: Problem):
        cfg = problem.config
        self.cfg = cfg
        self.x = _mp_matrix(problem.x)
        w = problem.weights
        self.w_gate = [_mp_matrix(w.w_gate[f]) for f in range(cfg.num_banks)]
        self.w_up = [_mp_matrix(w.w_up[f]) for f in range(cfg.num_banks)]
        self.w_down = [_mp_matrix(w.w_down[f]) for f in range(cfg.num_banks)]
        self.routes = _routes(problem)

    def xs(self, r: _Route) -> list:
        Dh = self.cfg.head_dim
        return self.x[r.token][r.head * Dh:(r.head + 1) * Dh]


def _by_output(numbers: _Numbers, per_route: list[list]) -> dict[tuple[int, int], list[list]]:
    groups: dict[tuple[int, int], list[list]] = {}
    for r, values in zip(numbers.routes, per_route):
        groups.setdefault((r.token, r.head), []).append(values)
    return groups


def exact_output(numbers: _Numbers) -> dict[tuple[int, int], list]:
    """``y[(s, h)]`` per column, exactly (256-bit)."""
    cfg = numbers.cfg
    Dh, I = cfg.head_dim, cfg.intermediate_size
    per_route = []
    for r in numbers.routes:
        xs = numbers.xs(r)
        wg, wu, wd = numbers.w_gate[r.bank], numbers.w_up[r.bank], numbers.w_down[r.bank]
        a = [_swiglu_exact(mpmath.fsum(xs[d] * wg[d][i] for d in range(Dh)),
                           mpmath.fsum(xs[d] * wu[d][i] for d in range(Dh))) for i in range(I)]
        per_route.append([r.prob * mpmath.fsum(a[i] * wd[i][j] for i in range(I)) for j in range(Dh)])
    return {key: [mpmath.fsum(col) for col in zip(*rows)]
            for key, rows in _by_output(numbers, per_route).items()}


def simulated_output(numbers: _Numbers, model: PrecisionModel, *, accumulate: str, seed: int,
                     downcast: str = "nearest"):
    """The model's rounding chain, exactly: random summation orders, each op rounded;
    ``accumulate`` / ``downcast``: rounding mode of the accumulators / of the narrow roundings."""
    rng = random.Random(seed)
    cfg = numbers.cfg
    Dh, I = cfg.head_dim, cfg.intermediate_size
    acc_fmt, ev = model.accumulate, model.evaluate

    def rounded(v, fmt):
        return v if fmt is None else mp_round(v, fmt, downcast)

    def dot(terms):
        terms = [mp_round(t, acc_fmt) for t in terms]  # exact for bf16 x bf16 in fp32
        rng.shuffle(terms)
        total = terms[0]
        for t in terms[1:]:
            total = mp_round(total + t, acc_fmt, accumulate)
        return total

    per_route = []
    for r in numbers.routes:
        xs = numbers.xs(r)
        wg, wu, wd = numbers.w_gate[r.bank], numbers.w_up[r.bank], numbers.w_down[r.bank]
        a = []
        for i in range(I):
            g = rounded(dot([xs[d] * wg[d][i] for d in range(Dh)]), model.round_gate_up)
            u = rounded(dot([xs[d] * wu[d][i] for d in range(Dh)]), model.round_gate_up)
            act = swiglu_fp32_sequence(g, u, ev, exp_ulps=rng.randint(-2, 2) if ev is FP32 else 0)
            a.append(rounded(act, model.round_activation))
        o = [rounded(dot([a[i] * wd[i][j] for i in range(I)]), model.round_down) for j in range(Dh)]
        per_route.append([rounded(mp_round(r.prob * oj, ev), model.round_route) for oj in o])
    result = {}
    for key, rows in _by_output(numbers, per_route).items():
        cols = []
        for col in zip(*rows):
            col = list(col)
            rng.shuffle(col)
            total = col[0]
            for c in col[1:]:
                total = mp_round(total + c, acc_fmt, accumulate)
            cols.append(rounded(total, model.round_output))
        result[key] = cols
    return result


def _as_tensor(values: dict[tuple[int, int], list], problem: Problem) -> list[list]:
    """``[S][H*Dh]`` nested lists of mpf; outputs without routes are 0."""
    cfg = problem.config
    rows = [[mpmath.mpf(0)] * cfg.hidden_size for _ in range(problem.num_tokens)]
    for (s, h), cols in values.items():
        rows[s][h * cfg.head_dim:(h + 1) * cfg.head_dim] = cols
    return rows


def check_simulation(problem: Problem, model: PrecisionModel | str, *, accumulate: str = "nearest",
                     downcast: str = "nearest", seed: int = 0, label: str = "") -> Check:
    """The simulated chain's true error must lie under the worst-case bound everywhere. With
    ``downcast="truncate"`` the narrow roundings go toward zero and the bound is the model's
    ``+rz`` variant (the Triton interpreter's behaviour)."""
    model = precision_model(model, problem.x.dtype)
    bound_model = with_truncating_downcasts(model) if downcast == "truncate" else model
    bounds = compute_error_bounds(problem.x, problem.table, problem.weights, problem.config,
                                  [bound_model])[bound_model.name]
    with mpmath.workprec(PREC):
        numbers = _Numbers(problem)
        exact = _as_tensor(exact_output(numbers), problem)
        sim = _as_tensor(simulated_output(numbers, model, accumulate=accumulate, seed=seed,
                                          downcast=downcast), problem)
        worst, prob = bounds.worst.tolist(), bounds.probabilistic.tolist()
        ratio_w = ratio_p = 0.0
        for s, row in enumerate(exact):
            for c, y in enumerate(row):
                err = float(abs(sim[s][c] - y))
                ratio_w = max(ratio_w, err / worst[s][c])
                ratio_p = max(ratio_p, err / prob[s][c])
    name = (f"exact simulation, {bound_model.name}, {accumulate} accumulators"
            f"{', truncating downcasts' if downcast == 'truncate' else ''}{', ' + label if label else ''}")
    return Check(name, ratio_w <= 1.0,
                 f"max true error / worst-case bound {ratio_w:.3g} (/ probabilistic {ratio_p:.3g})")


def check_reference(problem: Problem, label: str = "") -> Check:
    """The float64 reference recomputed by the bounds lies within its own float64 bound of the
    exact value (this error is what both bounds add for the reference)."""
    bounds = compute_error_bounds(problem.x, problem.table, problem.weights, problem.config,
                                  [MODEL_FLOAT64])["float64"]
    with mpmath.workprec(PREC):
        exact = _as_tensor(exact_output(_Numbers(problem)), problem)
        ref, worst = bounds.reference.tolist(), bounds.worst.tolist()
        ratio = max(float(abs(mpmath.mpf(ref[s][c]) - y)) / worst[s][c]
                    for s, row in enumerate(exact) for c, y in enumerate(row))
    return Check(f"float64 reference error{', ' + label if label else ''}", ratio <= 1.0,
                 f"max |reference - exact| / float64 bound = {ratio:.3g}")


def mp_worst_bound(problem: Problem, model: PrecisionModel) -> list[list]:
    """The worst-case bound of :mod:`magi_moe.judge.bounds` (without the reference term) evaluated
    element by element in mpmath from the route list."""
    cfg = problem.config
    Dh, I, K = cfg.head_dim, cfg.intermediate_size, cfg.top_k
    numbers = _Numbers(problem)
    acc_u = mpmath.mpf(model.accumulate_unit)
    acc_eta = mpmath.mpf(model.accumulate.underflow)
    gam = lambda n: n * acc_u / (1 - n * acc_u)  # noqa: E731

    def rnd(fmt, mag):
        return 0 if fmt is None else fmt.unit * mag + mpmath.mpf(fmt.underflow)

    per_route = []
    for r in numbers.routes:
        xs = numbers.xs(r)
        wg, wu, wd = numbers.w_gate[r.bank], numbers.w_up[r.bank], numbers.w_down[r.bank]
        da, a_abs, a_vals = [], [], []
        for i in range(I):
            g = mpmath.fsum(xs[d] * wg[d][i] for d in range(Dh))
            u = mpmath.fsum(xs[d] * wu[d][i] for d in range(Dh))
            eg = gam(Dh + 1) * mpmath.fsum(abs(xs[d] * wg[d][i]) for d in range(Dh)) + Dh * acc_eta
            eu = gam(Dh + 1) * mpmath.fsum(abs(xs[d] * wu[d][i]) for d in range(Dh)) + Dh * acc_eta
            eg, eu = eg + rnd(model.round_gate_up, abs(g) + eg), eu + rnd(model.round_gate_up, abs(u) + eu)
            v = max(min(u, LIMIT), -LIMIT) + 1
            a = _f(g) * v
            prop = (min(F1_MAX, abs(_f_prime(g)) + F2_MAX * eg) * eg * min(abs(v) + eu, LIMIT + 1)
                    + abs(_f(g)) * eu)
            mag = abs(a) + prop
            ev = ((EVAL_OPS + EVAL_ARG * ALPHA * (abs(g) + eg)) * model.evaluate.unit * mag
                  + EVAL_UNDERFLOW)
            da.append(prop + ev + rnd(model.round_activation, mag + ev))
            a_abs.append(abs(a))
            a_vals.append(a)
        terms = []
        for j in range(Dh):
            o = mpmath.fsum(a_vals[i] * wd[i][j] for i in range(I))
            s1 = mpmath.fsum(da[i] * abs(wd[i][j]) for i in range(I))
            aw = mpmath.fsum((a_abs[i] + da[i]) * abs(wd[i][j]) for i in range(I))
            e_o = s1 + gam(I + 1) * aw + I * acc_eta
            e_o += rnd(model.round_down, abs(o) + e_o)
            p = abs(r.prob)
            e_c = p * e_o + model.evaluate.unit * p * (abs(o) + e_o) + mpmath.mpf(model.evaluate.underflow)
            e_c += rnd(model.round_route, p * abs(o) + e_c)
            terms.append((e_c, p * abs(o) + e_c, r.prob * o))
        per_route.append(terms)
    out = {}
    for key, rows in _by_output(numbers, per_route).items():
        cols = []
        for col in zip(*rows):
            e_y = sum(t[0] for t in col) + gam(K) * sum(t[1] for t in col) + K * acc_eta
            y = sum(t[2] for t in col)
            cols.append(e_y + rnd(model.round_output, abs(y) + e_y))
        out[key] = cols
    return _as_tensor(out, problem)


def check_formula(problem: Problem, model: PrecisionModel | str, label: str = "") -> Check:
    """Vectorised float64 bound == element-wise mpmath bound (to float64 rounding)."""
    model = precision_model(model, problem.x.dtype)
    bounds = compute_error_bounds(problem.x, problem.table, problem.weights, problem.config,
                                  [model, MODEL_FLOAT64])
    vec = (bounds[model.name].worst - bounds["float64"].worst / 2).tolist()
    with mpmath.workprec(PREC):
        mp = mp_worst_bound(problem, model)
        rel = max(float(abs(mpmath.mpf(vec[s][c]) - b) / b)
                  for s, row in enumerate(mp) for c, b in enumerate(row))
    return Check(f"vectorised bound == mpmath formula, {model.name}{', ' + label if label else ''}",
                 rel < 1e-9, f"max relative difference {rel:.2e}")


def tiny_problems(seed: int = 0, num_tokens: int = 3) -> dict[str, Problem]:
    """The random problem and the probes at :data:`TINY` shapes."""
    from .probes import PROBES
    return {name: probe_problem(name, TINY, num_tokens, seed=seed) for name in PROBES}


def iter_checks(*, seed: int = 0, quick: bool = False) -> Iterator[Check]:
    """Every check, yielded as it completes; ``quick`` limits the exact simulations to the
    random and swamp probes."""
    yield from check_constants(seed)
    problems = tiny_problems(seed)
    if quick:
        problems = {k: problems[k] for k in ("random", "swamp")}
    for name, problem in problems.items():
        yield check_reference(problem, name)
        for model in ("bf16-fp32acc", "bf16-plain"):
            if name == "random":
                yield check_formula(problem, model, name)
            for mode in ("nearest", "truncate"):
                yield check_simulation(problem, model, accumulate=mode, seed=seed, label=name)
        yield check_simulation(problem, "bf16-fp32acc", accumulate="truncate",
                               downcast="truncate", seed=seed, label=name)


def run_all(*, seed: int = 0, quick: bool = False) -> list[Check]:
    return list(iter_checks(seed=seed, quick=quick))
