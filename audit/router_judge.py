"""The router judge: are a router's routes the routes of CONTRACT section 1?

    from magi_moe.audit.router_judge import judge_router, judge_router_call
    v = judge_router(routes, x, gate, bias, config)          # routes already computed
    v = judge_router_call(impl.route, x, gate, bias, config)  # runs it, adds head locality
    assert v.ok, v.text                                       # v.failed: the broken rules

Every router the suite meets (magi-moe's torch and fused routers, an implementation's declared
``router``) is judged by this one function, in ``magi-moe check``, the audit and the fuzzers.
The routes are compared with magi-moe's float64 router (:func:`magi_moe.routing.route` with
``dtype=torch.float64``) on the same inputs. The checks, each named in the verdict:

- ``form``: ``expert_ids`` int64 and ``probs`` fp32/float64, both ``[S, H, K]``; experts in
  ``[0, E)`` (experts of the token's own head) and distinct. When it fails nothing else is read.
- ``selection``: the chosen experts, as a set per (token, head), are the float64 top-K of the
  selection scores ``score + bias``, except for *near-ties* (below). When the choices are the
  top-K of the unbiased scores instead, the check is named ``bias_ignored``.
- ``tie_rule``: equal float64 selection scores (exact ties: equal in exact arithmetic for the
  grid inputs that build them, and equal in fp32 too) go to the lower expert index, and come
  first; among NaN selection scores the lower index first. A near-tie margin never excuses one.
- ``nan_last``: a NaN selection score ranks below every number, ``-inf`` included.
- ``order``: the K choices highest selection first (CONTRACT section 1 step 4).
- ``weights``: each weight is the chosen expert's *unbiased* float64 score, L1-normalised by
  ``max(sum, 1e-12)`` when ``route_norm``, times ``route_scale``, within the fp32 error bound
  below; a NaN score gives a NaN weight (NaN in ``x`` routes by the NaN rule and is not hidden).
  Computed on the router's own choices, so a near-tie choice does not fail its weights. When a
  known mistake explains every failing weight, the check is named after the rule it breaks:
  ``l1_normalisation`` (normalised when not asked, or not when asked), ``norm_eps`` (sum
  without the 1e-12 floor), ``bias_in_weights`` (the biased score weighs), ``route_scale``
  (missing, or applied twice).
- ``head_locality`` (:func:`judge_router_call` only): head h's routes do not move when every
  other head's slice of ``x``, its gate rows and its bias are redrawn.

**Near-ties and the rounding margin.** The router computes in fp32 what the judge computes in
float64. For each selection score the judge bounds the fp32 error (:func:`selection_margins`):
logits summed in fp32 in any order from up to ``4*Dh`` exact products (a split fp32 gate on bf16
tensor cores sums ``3*Dh``), ``|dl| <= gamma(4*Dh) * sum|x||gate|`` (Higham's gamma_n =
n u / (1 - n u), u = 2^-24); through sigmoid (its steepest slope on the logit's interval, plus
``(|l| + 8) u`` relative for evaluating it) or softmax (each probability within a factor set by
the logit errors, the rounding of the max-shift and exp, and the sum of E terms); plus one
rounding of ``score + bias`` and fp32's smallest normal number (a GPU may flush below it).
A choice of expert ``c`` over the float64 router's ``u`` is a near-tie, reported and not failed,
when the intervals overlap: ``sel[c] + m[c] >= sel[u] - m[u]``. The weights' tolerance follows
from the same score bounds through the normalisation (the sum perturbed by the chosen scores'
bounds, gamma(K) for the fp32 sum, 8u for the division (GPUs' fast division errs by up to two
ulps), the fp32 route_scale and the product).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from magi_moe.config import MoEConfig
from magi_moe.routing import (NORM_EPS, route_probs, router_logits, scores_from_logits,
                              select_experts)
from magi_moe.validation import check_tensor

__all__ = ["ROUTER_CHECKS", "WEIGHT_RULES", "Float64Routes", "RouterCheck", "RouterVerdict",
           "ambiguous_heads", "float64_routes", "judge_router", "judge_router_call",
           "other_heads_redrawn", "selection_margins"]

U = 2.0 ** -24           # fp32 unit roundoff
FP32_TINY = 2.0 ** -126  # fp32's smallest normal number: a GPU may flush below it
ROUTER_CHECKS = ("form", "selection", "tie_rule", "nan_last", "order", "weights", "head_locality")
# the names a failing ``weights`` (or ``selection``) check takes when one mistake explains it
WEIGHT_RULES = ("l1_normalisation", "norm_eps", "bias_in_weights", "route_scale")
SELECTION_RULES = ("bias_ignored",)


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


# -- the verdict -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterCheck:
    """One check's outcome: ``name`` (a rule of :data:`ROUTER_CHECKS`, or for a failing
    weights/selection check the rule a known mistake breaks), ``text`` with the first offender."""

    name: str
    ok: bool
    text: str
    figures: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RouterVerdict:
    subject: str
    checks: tuple[RouterCheck, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> tuple[str, ...]:
        """The names of the failing checks: the contract rules the router breaks."""
        return tuple(c.name for c in self.checks if not c.ok)

    def check(self, name: str) -> RouterCheck | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def near_ties(self) -> int:
        """(token, head) pairs whose choice differs from float64 within the rounding margin."""
        return sum(c.figures.get("near_ties", 0) for c in self.checks)

    @property
    def metrics(self) -> dict:
        return {c.name: dict(c.figures, ok=c.ok) for c in self.checks}

    @property
    def text(self) -> str:
        head = (f"{self.subject}: routes ok ({', '.join(c.name for c in self.checks)})" if self.ok
                else f"{self.subject}: routes FAILED on {', '.join(self.failed)}")
        return "\n".join([head] + [f"  {c.name}: {'ok' if c.ok else 'FAIL'}: {c.text}"
                                   for c in self.checks])


# -- the float64 router and its error bounds -------------------------------------------------------
@dataclass(frozen=True)
class Float64Routes:
    """magi-moe's float64 router on the judged inputs, on the CPU: ``[S, H, E]`` logits, scores,
    selection scores and their fp32 error bounds (``score_bound``, ``margin``), ``[S, H, K]``
    choices and weights."""

    logits: torch.Tensor
    scores: torch.Tensor
    selection: torch.Tensor
    score_bound: torch.Tensor
    margin: torch.Tensor
    expert_ids: torch.Tensor
    probs: torch.Tensor


def selection_margins(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                      config: MoEConfig, logits: torch.Tensor, scores: torch.Tensor,
                      selection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on the fp32 router's error in each score and each selection score (float64
    ``[S, H, E]``; see the module docstring for the derivation)."""
    abs_dot = router_logits(x.abs(), gate.abs(), config, torch.float64)
    dl = _gamma(4 * config.head_dim) * abs_dot
    if config.score_func == "sigmoid":
        nearest_zero = torch.minimum(torch.maximum(torch.zeros_like(logits), logits - dl), logits + dl)
        s0 = torch.sigmoid(nearest_zero)
        score_bound = s0 * (1 - s0) * dl + (logits.abs() + dl + 8) * U * scores
    else:
        row_max = logits.amax(-1, keepdim=True)
        dmax = dl.amax(-1, keepdim=True)
        per_term = torch.expm1(dl + 2 * U * ((logits - row_max).abs() + dmax + dl)) + 5 * U
        denominator = (scores * per_term).sum(-1, keepdim=True) + _gamma(config.num_experts)
        relative = (1 + per_term) * (1 + 4 * U) / (1 - denominator) - 1  # a division of 2 ulps
        score_bound = torch.where(denominator < 1, scores * relative, torch.full_like(scores, float("inf")))
    score_bound = score_bound + FP32_TINY
    margin = score_bound if bias is None else score_bound + U * (selection.abs() + score_bound)
    # an infinite selection score (an infinite bias) is exact in fp32 as well
    margin = torch.where(torch.isinf(selection), torch.zeros_like(margin), margin)
    return score_bound, margin


def float64_routes(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                   config: MoEConfig) -> Float64Routes:
    """The float64 router of :mod:`magi_moe.routing` (its tie and NaN rules included) on the
    CPU, with the fp32 error bounds of its scores."""
    x, gate = x.detach().cpu(), gate.detach().cpu()
    bias = None if bias is None else bias.detach().cpu()
    H, E = config.num_heads, config.num_experts
    logits = router_logits(x, gate, config, torch.float64)
    scores = scores_from_logits(logits, config.score_func)
    selection = scores if bias is None else scores + bias.reshape(H, E).double()
    ids = select_experts(selection, config.top_k)
    score_bound, margin = selection_margins(x, gate, bias, config, logits, scores, selection)
    return Float64Routes(logits, scores, selection, score_bound, margin, ids,
                         route_probs(scores, ids, config))


def ambiguous_heads(ref: Float64Routes, config: MoEConfig) -> torch.Tensor:
    """``[S, H]`` bool: (token, head) pairs whose top-K an fp32 router may choose otherwise than
    the float64 one without breaking the contract, because a chosen and an unchosen expert's
    selection scores lie within each other's fp32 rounding margin (a near-tie). Exact ties are
    not ambiguous: the tie rule decides them. A layer's output on such a head depends on which
    choice its router made, so judges that hold a layer to the float64 routes set them aside
    (the routing clause judges the choice itself)."""
    S, H, E, K = ref.selection.shape[0], config.num_heads, config.num_experts, config.top_k
    if K >= E or S == 0:
        return torch.zeros(S, H, dtype=torch.bool)
    chosen = torch.zeros(S, H, E, dtype=torch.bool).scatter_(-1, ref.expert_ids, True)
    unchosen_ids = (~chosen).nonzero()[:, 2].reshape(S, H, E - K)
    a, b, slack = _score_pairs(ref, ref.expert_ids, unchosen_ids)
    near = (a - slack <= b) & (a != b) & torch.isfinite(a) & torch.isfinite(b)
    return near.flatten(2).any(-1)


def _score_pairs(ref: Float64Routes, left: torch.Tensor, right: torch.Tensor):
    """Every (left, right) pair of experts of one (token, head): the selection scores of
    ``left`` ``[S, H, L]`` as ``[S, H, L, 1]`` and of ``right`` ``[S, H, M]`` as ``[S, H, 1, M]``,
    and the pair's two fp32 rounding margins summed ``[S, H, L, M]`` (the two scores' intervals
    overlap where they are that close)."""
    sel, margin = ref.selection, ref.margin
    a, b = torch.gather(sel, -1, left)[..., :, None], torch.gather(sel, -1, right)[..., None, :]
    slack = torch.gather(margin, -1, left)[..., :, None] + torch.gather(margin, -1, right)[..., None, :]
    return a, b, slack


# -- the checks ------------------------------------------------------------------------------------
def _form(routes, config: MoEConfig, num_tokens: int) -> RouterCheck:
    H, E, K = config.num_heads, config.num_experts, config.top_k
    try:
        ids = check_tensor("routes.expert_ids", getattr(routes, "expert_ids", None),
                           shape=(num_tokens, H, K), dtype=torch.int64)
        check_tensor("routes.probs", getattr(routes, "probs", None), shape=(num_tokens, H, K),
                     dtype=(torch.float32, torch.float64))
    except (TypeError, ValueError) as exc:
        return RouterCheck("form", False, str(exc))
    if ids.numel():
        ids = ids.detach().cpu()
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= E:
            return RouterCheck("form", False, f"expert ids must lie in [0, {E}) (the experts of the "
                                              f"token's own head), got values in [{lo}, {hi}]")
        ranked = ids.sort(-1).values
        repeats = (ranked[..., 1:] == ranked[..., :-1]).any(-1)
        if bool(repeats.any()):
            s, h = repeats.nonzero()[0].tolist()
            return RouterCheck("form", False, f"token {s} head {h} chose {ids[s, h].tolist()}: "
                                              f"{K} distinct experts expected")
    return RouterCheck("form", True, f"[{num_tokens}, {H}, {K}] int64 ids in [0, {E}), distinct")


def _where(mask: torch.Tensor) -> tuple[int, int]:
    s, h = mask.nonzero()[0].tolist()[:2]
    return s, h


def _row(ref: Float64Routes, got: torch.Tensor, s: int, h: int) -> str:
    sel = ref.selection[s, h]
    chosen = ", ".join(f"{e} ({float(sel[e]):.9g})" for e in got[s, h].tolist())
    expected = ", ".join(f"{e} ({float(sel[e]):.9g})" for e in ref.expert_ids[s, h].tolist())
    return f"token {s} head {h} chose [{chosen}], the float64 router [{expected}]"


def _choice_checks(ids: torch.Tensor, ref: Float64Routes, config: MoEConfig) -> list[RouterCheck]:
    """selection / tie_rule / nan_last: every (chosen not in T, in T not chosen) pair, T the
    float64 top-K; then the order of the K choices."""
    S, H, E = ids.shape[0], config.num_heads, config.num_experts
    sel, margin, want = ref.selection, ref.margin, ref.expert_ids

    def member(of: torch.Tensor, ask: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(S, H, E, dtype=torch.bool)
        mask.scatter_(-1, of, True)
        return torch.gather(mask, -1, ask)

    extra = ~member(want, ids)     # chosen, not in the float64 top-K   [S, H, K]
    missed = ~member(ids, want)    # in the float64 top-K, not chosen
    pair = extra[..., :, None] & missed[..., None, :]
    a, b, slack = _score_pairs(ref, ids, want)
    nan_c, nan_u = torch.isnan(a), torch.isnan(b)
    tie = pair & ((nan_c & nan_u) | (a == b))
    nan_first = pair & nan_c & ~nan_u
    within = (a + slack >= b) | ~torch.isfinite(slack)  # the two fp32 intervals overlap
    near = pair & ~tie & ~nan_first & ~nan_u & within
    wrong = pair & ~tie & ~nan_first & ~near
    rows = lambda m: m.flatten(2).any(-1)  # noqa: E731 -- [S, H]: any such pair in the row
    checks = []
    near_rows, wrong_rows = rows(near) & ~rows(wrong | tie | nan_first), rows(wrong)
    if bool(wrong_rows.any()):
        s, h = _where(wrong_rows)
        name, why = "selection", ("not the top-K of the selection scores score + bias, beyond the "
                                  "rounding margin")
        unbiased = select_experts(ref.scores, config.top_k)
        if sel is not ref.scores and bool(  # a bias was given (float64_routes)
                (ids.sort(-1).values == unbiased.sort(-1).values)[wrong_rows].all()):
            name, why = "bias_ignored", "the top-K of the unbiased scores: the bias must steer the choice"
        checks.append(RouterCheck(name, False, f"{int(wrong_rows.sum())} (token, head) pairs chose "
                                  f"{why}; first: {_row(ref, ids, s, h)}",
                                  {"rows": int(wrong_rows.sum()), "near_ties": int(near_rows.sum())}))
    else:
        checks.append(RouterCheck("selection", True, f"the float64 top-K; {int(near_rows.sum())} "
                                  "near-tie (token, head) pairs within the fp32 rounding margin",
                                  {"near_ties": int(near_rows.sum())}))
    # the order of the K choices: highest first, ties lower index first, NaN last
    first, second = ids[..., :-1], ids[..., 1:]
    sa, sb = torch.gather(sel, -1, first), torch.gather(sel, -1, second)
    ma, mb = torch.gather(margin, -1, first), torch.gather(margin, -1, second)
    na, nb = torch.isnan(sa), torch.isnan(sb)
    tie_in_order = ((na & nb) | (sa == sb)) & (first > second)
    misordered = ~na & ~nb & (sa < sb) & ~(sa + ma >= sb - mb)
    tie_rows = rows(tie) | tie_in_order.any(-1)
    nan_rows = rows(nan_first) | (na & ~nb).any(-1)
    for name, bad, rule in (
            ("tie_rule", tie_rows, "exact ties must go to the lower index, which comes first"),
            ("nan_last", nan_rows, "a NaN selection score ranks below every number, -inf included"),
            ("order", misordered.any(-1), "the choices must come highest selection score first")):
        if bool(bad.any()):
            s, h = _where(bad)
            checks.append(RouterCheck(name, False, f"{int(bad.sum())} (token, head) pairs: {rule}; "
                                      f"first: {_row(ref, ids, s, h)}", {"rows": int(bad.sum())}))
        else:
            checks.append(RouterCheck(name, True, rule))
    return checks


def _weight_bounds(ids: torch.Tensor, ref: Float64Routes, config: MoEConfig):
    """``(expected, lo, hi)`` ``[S, H, K]`` float64: the contract's weights of these choices and
    the interval an fp32 router may return."""
    sc = torch.gather(ref.scores, -1, ids)
    ac = torch.gather(ref.score_bound, -1, ids)
    scale, K = config.route_scale, config.top_k
    expected = route_probs(ref.scores, ids, config)
    low_s, high_s = (sc - ac).clamp_min(0), sc + ac
    if config.route_norm:
        total, slack, g = sc.sum(-1, keepdim=True), ac.sum(-1, keepdim=True), _gamma(K)
        d_lo = torch.clamp_min((total - slack) * (1 - g), NORM_EPS * (1 - U))
        d_hi = torch.clamp_min((total + slack) * (1 + g), NORM_EPS * (1 + U))
        low_s, high_s = low_s / d_hi, high_s / d_lo
    return expected, scale * low_s * (1 - 8 * U), scale * high_s * (1 + 8 * U)


def _close(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    return ((got - want).abs() <= tol + 1e-4 * want.abs()) | (torch.isnan(got) & torch.isnan(want))


def _weights(ids: torch.Tensor, probs: torch.Tensor, ref: Float64Routes, config: MoEConfig,
             has_bias: bool) -> RouterCheck:
    got = probs.detach().cpu().double()
    expected, lo, hi = _weight_bounds(ids, ref, config)
    tol = torch.maximum(hi - expected, expected - lo)
    ok = ((got >= lo) & (got <= hi)) | (torch.isnan(expected) & torch.isnan(got))
    nan_rows = torch.isnan(expected).any(-1).sum()
    if bool(ok.all()):
        finite = torch.isfinite(expected) & (tol > 0)
        worst = float(((got - expected).abs() / tol)[finite].max()) if bool(finite.any()) else 0.0
        return RouterCheck("weights", True, f"unbiased scores, normalised and scaled, within the fp32 "
                           f"bound (worst |error|/bound {worst:.3g}; {int(nan_rows)} NaN rows stay NaN)",
                           {"worst_ratio": worst})
    bad_rows = (~ok).any(-1)
    s, h = _where(bad_rows)
    k = int((~ok[s, h]).nonzero()[0, 0])
    detail = (f"{int((~ok).sum())} of {ok.numel()} weights outside the fp32 bound; first: token {s} "
              f"head {h} expert {int(ids[s, h, k])}: {float(got[s, h, k]):.9g}, expected "
              f"{float(expected[s, h, k]):.9g} +- {float(tol[s, h, k]):.3g}")
    rule = _diagnose(got, ids, ref, config, has_bias, bad_rows, tol)
    name, why = rule if rule else ("weights", "")
    return RouterCheck(name, False, detail + (f"; {why}" if why else ""),
                       {"bad": int((~ok).sum()), "rule": name})


def _diagnose(got, ids, ref: Float64Routes, config: MoEConfig, has_bias: bool, bad_rows, tol):
    """The one known mistake that explains every failing row's weights, or None."""
    sc = torch.gather(ref.scores, -1, ids)
    scale, total = config.route_scale, sc.sum(-1, keepdim=True)
    expected = route_probs(ref.scores, ids, config)
    candidates = []
    if config.route_norm:
        candidates += [("l1_normalisation", scale * sc,
                        "the weights are the scaled scores, not L1-normalised (CONTRACT 1 step 5)"),
                       ("norm_eps", scale * sc / total,
                        "the L1 sum is used without its 1e-12 floor max(sum, 1e-12)")]
    else:
        candidates.append(("l1_normalisation", scale * sc / total.clamp_min(NORM_EPS),
                           "the weights are L1-normalised although route_norm is off"))
    if has_bias:
        candidates.append(("bias_in_weights", route_probs(ref.selection, ids, config),
                           "the weights come from the biased selection scores: the bias may only "
                           "steer the choice"))
    candidates += [("route_scale", expected / scale, "route_scale is missing"),
                   ("route_scale", expected * scale, "route_scale is applied twice")]
    rows = bad_rows[..., None].expand_as(got)
    for name, alternative, why in candidates:
        if bool(_close(got[rows], alternative[rows], tol[rows]).all()):
            return name, why
    return None


def judge_router(routes, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                 config: MoEConfig, *, subject: str = "router",
                 reference: Float64Routes | None = None) -> RouterVerdict:
    """Judge ``routes`` (``expert_ids``, ``probs``) of ``x`` ``[S, H*Dh]`` with ``gate`` and
    ``bias`` against the float64 router: the checks of the module docstring but head locality.
    ``reference``: :func:`float64_routes` of these inputs, when the caller holds it."""
    check_tensor("x", x, shape=(None, config.hidden_size))
    check_tensor("gate", gate, shape=(config.num_banks, config.head_dim))
    if bias is not None:
        check_tensor("bias", bias, shape=(config.num_banks,))
    form = _form(routes, config, x.shape[0])
    if not form.ok:
        return RouterVerdict(subject, (form,))
    ref = reference if reference is not None else float64_routes(x, gate, bias, config)
    ids = routes.expert_ids.detach().cpu()
    checks = [form] + _choice_checks(ids, ref, config)
    checks.append(_weights(ids, routes.probs, ref, config, bias is not None))
    return RouterVerdict(subject, tuple(checks))


# -- head locality ---------------------------------------------------------------------------------
def other_heads_redrawn(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
                        config: MoEConfig, head: int, *, seed: int = 0):
    """``(x, gate, bias)`` with every head but ``head`` redrawn: its slice of ``x`` (rows
    reversed, negated, plus noise), its gate rows (negated, plus noise) and its bias (new)."""
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    gen = torch.Generator().manual_seed(seed)
    x2, gate2 = x.clone(), gate.clone()
    bias2 = None if bias is None else bias.clone()
    for h in range(H):
        if h == head:
            continue
        cols, banks = slice(h * Dh, (h + 1) * Dh), slice(h * E, (h + 1) * E)
        noise = torch.randn(x.shape[0], Dh, generator=gen).to(x.device)
        x2[:, cols] = (-x[:, cols].float().flip(0) + noise).to(x.dtype)
        gate2[banks] = -gate[banks] + 0.25 * torch.randn(E, Dh, generator=gen).to(gate.device, gate.dtype)
        if bias2 is not None:
            bias2[banks] = 0.1 * torch.randn(E, generator=gen).to(bias.device, bias.dtype)
    return x2, gate2, bias2


def _head_locality(route_fn, x, gate, bias, config, ids, probs, ref: Float64Routes,
                   heads) -> RouterCheck:
    _, lo, hi = _weight_bounds(ids, ref, config)
    width = hi - lo  # two weights inside one fp32 bound differ by at most its width
    moved = []
    for head in heads:
        x2, gate2, bias2 = other_heads_redrawn(x, gate, bias, config, head, seed=head)
        again = route_fn(x2, gate2, bias2, config)
        ids2 = again.expert_ids.detach().cpu()
        probs2 = again.probs.detach().cpu().double()
        if ids2.shape != ids.shape:
            moved.append(f"head {head}: the second call returned shape {tuple(ids2.shape)}")
            continue
        same_ids = (ids2[:, head] == ids[:, head]).all(-1)
        p = probs2[:, head]
        first = probs[:, head]
        same_p = ((p - first).abs() <= width[:, head]) | (torch.isnan(p) & torch.isnan(first))
        bad = ~same_ids | ~same_p.all(-1)
        if bool(bad.any()):
            s = int(bad.nonzero()[0, 0])
            moved.append(f"head {head} token {s}: {ids[s, head].tolist()} "
                         f"{[round(v, 6) for v in probs[s, head].tolist()]} became "
                         f"{ids2[s, head].tolist()} {[round(v, 6) for v in p[s].tolist()]} "
                         f"({int(bad.sum())} tokens moved)")
    if moved:
        return RouterCheck("head_locality", False, "a head's routes moved when only other heads' "
                           "x, gate rows and bias changed: " + "; ".join(moved), {"heads": list(heads)})
    return RouterCheck("head_locality", True, f"heads {list(heads)} unmoved when every other head "
                       "was redrawn", {"heads": list(heads)})


def judge_router_call(route_fn: Callable, x: torch.Tensor, gate: torch.Tensor,
                      bias: torch.Tensor | None, config: MoEConfig, *, subject: str = "router",
                      heads: tuple[int, ...] | None = None) -> RouterVerdict:
    """Run ``route_fn(x, gate, bias, config)`` (e.g. ``impl.route``), judge its routes
    (:func:`judge_router`), then rerun it once per head of ``heads`` (default: every head) with
    every other head redrawn: that head's choices must stay the same and its weights move by no
    more than the width of their fp32 bound (``head_locality``)."""
    routes = route_fn(x, gate, bias, config)
    ref = float64_routes(x, gate, bias, config)
    verdict = judge_router(routes, x, gate, bias, config, subject=subject, reference=ref)
    if not verdict.checks[0].ok:  # form: nothing to compare
        return verdict
    heads = tuple(range(config.num_heads)) if heads is None else tuple(h % config.num_heads for h in heads)
    ids, probs = routes.expert_ids.detach().cpu(), routes.probs.detach().cpu().double()
    locality = _head_locality(route_fn, x, gate, bias, config, ids, probs, ref, heads)
    return RouterVerdict(subject, verdict.checks + (locality,))
