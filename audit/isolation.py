"""Row isolation (CONTRACT 1): a (token, head) output depends only on that token's row of ``x``,
its routes and the weights. NaN, Inf or finite garbage in other rows (padding rows included)
never reaches it; a row whose own input is poisoned may hold anything.

The check poisons some rows of a clean problem and judges only the other rows, with the one
accuracy judge, against the float64 reference of the *clean* problem made of those rows alone
(same routes). Three route modes separate what the poison can travel through:

* ``unrouted``: the poisoned rows have no route (the route table is the clean rows' table), so
  only a reduction over all of ``x`` (a per-tensor scale, a normalisation) can carry it;
* ``own``: the poisoned rows keep their own routes;
* ``shared``: each poisoned row takes the routes of a clean row, so every expert it reaches also
  serves clean rows (where a per-expert dynamic scale, an amax over the expert's rows, spreads
  NaN).

:func:`check_layer_row_isolation` is the same rule for an implementation's own layer, routing
included: the routing of a token depends only on its own row (CONTRACT 1's NaN rule).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from magi_moe.implementation import Implementation
from magi_moe.judge import Inaccurate, judge
from magi_moe.judge.bounds import DEFAULT_FAILURE_PROBABILITY
from magi_moe.problems import Problem, run_poisoned
from magi_moe.routing import Routes, build_route_table
from magi_moe.verdict import LayerWrongOnItsOwn

__all__ = ["POISONS", "ROUTE_MODES", "IsolationResult", "check_layer_row_isolation",
           "check_row_isolation", "isolation_problems", "poison_rows", "poisoned_rows"]

POISONS = (
    "nan",       # NaN in some elements of the row
    "inf",       # +Inf and -Inf
    "garbage",   # finite values near the dtype's maximum: the products overflow
    "mixed",     # all three in one row
)
ROUTE_MODES = ("unrouted", "own", "shared")


def poisoned_rows(num_tokens: int, *, seed: int, share: float = 0.25, padding: bool = False) -> torch.Tensor:
    """A boolean ``[S]`` mask: about ``share`` of the rows, at least one, never all of them
    (``S >= 2``): the last rows with ``padding`` (as a CUDA graph pads a batch to its captured
    size), else rows chosen from ``seed``."""
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2 (a poisoned row and a clean one), got {num_tokens}")
    if not 0 < share < 1:
        raise ValueError(f"share must lie in (0, 1), got {share}")
    gen = torch.Generator().manual_seed(int(seed) % 2**63)
    count = min(num_tokens - 1, max(1, round(share * num_tokens)))
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    if padding:
        mask[num_tokens - count:] = True
    else:
        mask[torch.randperm(num_tokens, generator=gen)[:count]] = True
    return mask


def poison_rows(x: torch.Tensor, rows: torch.Tensor, poison: str, *, seed: int) -> torch.Tensor:
    """``x`` with the rows of mask ``rows`` poisoned by ``poison`` (one of :data:`POISONS`): a
    random half of each row's elements (at least one per row), so finite values stay beside it."""
    if poison not in POISONS:
        raise ValueError(f"poison must be one of {POISONS}, got {poison!r}")
    gen = torch.Generator().manual_seed(int(seed) % 2**63)
    S, D = x.shape
    hit = torch.rand(S, D, generator=gen) < 0.5
    hit[torch.arange(S), torch.randint(0, D, (S,), generator=gen)] = True
    hit &= rows.cpu()[:, None]
    sign = torch.where(torch.rand(S, D, generator=gen) < 0.5, -1.0, 1.0)
    big = torch.finfo(x.dtype).max * (0.5 + 0.5 * torch.rand(S, D, generator=gen))
    values = {"nan": torch.full((S, D), float("nan")), "inf": sign * float("inf"),
              "garbage": (sign * big).to(x.dtype).float()}
    if poison == "mixed":
        pick = torch.randint(0, 3, (S, D), generator=gen)
        bad = torch.where(pick == 0, values["nan"], torch.where(pick == 1, values["inf"], values["garbage"]))
    else:
        bad = values[poison]
    out = x.clone()
    out[hit.to(x.device)] = bad[hit].to(dtype=x.dtype, device=x.device)
    return out


def _checked_rows(rows: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
    if (not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (num_tokens,) or rows.dtype != torch.bool
            or not bool(rows.any()) or bool(rows.all())):
        raise ValueError(f"rows must be a boolean [{num_tokens}] mask with at least one poisoned and one "
                         "clean row")
    return rows.to(device)


def _take(routes: Routes, index: torch.Tensor) -> Routes:
    return Routes(routes.expert_ids[index], routes.probs[index])


def isolation_problems(problem: Problem, rows: torch.Tensor, poison: str, mode: str, *,
                       seed: int) -> tuple[Problem, Problem, torch.Tensor]:
    """``(poisoned, clean, kept)``: ``problem`` with the rows of mask ``rows`` poisoned and routed
    by ``mode`` (one of :data:`ROUTE_MODES`); the clean problem made of the other rows alone, with
    their routes; and those rows' indices (``poisoned``'s output rows ``kept`` are judged against
    ``clean``). Hand-emptied banks (``drop_banks``) are not kept: build from the routes."""
    if mode not in ROUTE_MODES:
        raise ValueError(f"mode must be one of {ROUTE_MODES}, got {mode!r}")
    cfg, S = problem.config, problem.num_tokens
    rows = _checked_rows(rows, S, problem.x.device)
    kept = (~rows).nonzero().flatten()
    routes = problem.routes
    if mode == "shared":  # poisoned row i takes the routes of a clean row
        donors = kept[torch.arange(S, device=kept.device) % kept.numel()]
        source = torch.where(rows, donors, torch.arange(S, device=kept.device))
        routes = _take(routes, source)
    table = build_route_table(routes, cfg)
    if mode == "unrouted":
        table = table.select(~rows[table.gather_ids.long()])
    x = poison_rows(problem.x, rows, poison, seed=seed)
    poisoned = Problem(cfg, x, problem.gate, problem.bias, problem.weights, routes, table)
    clean_routes = _take(problem.routes, kept)
    clean = Problem(cfg, problem.x[kept], problem.gate, problem.bias, problem.weights, clean_routes,
                    build_route_table(clean_routes, cfg))
    return poisoned, clean, kept


@dataclass(frozen=True)
class IsolationResult:
    ok: bool
    text: str
    ratio: float = float("nan")  # the judge's error / bound on the clean rows
    # the clean rows are as wrong without any poisoned row beside them: an accuracy finding
    # (raise it; the verdict counts it under accuracy), not one of isolation
    inaccurate: Inaccurate | None = None


def _judge_rows(out_rows: torch.Tensor, kept: torch.Tensor, clean: Problem, impl: Implementation | str,
                what: str, failure_probability: float,
                poisoned: Problem | None = None) -> IsolationResult:
    """Judge the clean rows ``out_rows`` (the tokens ``kept`` of the poisoned call, on the problem
    ``poisoned`` where known: faithfulness then compares with its emulation's rows)."""
    bad = ~torch.isfinite(out_rows)
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        return IsolationResult(False, f"{what}: {int(bad.any(-1).sum())} of {out_rows.shape[0]} clean "
                                      f"rows are not finite, first token {int(kept[r])} at column {c}: "
                                      f"{float(out_rows[r, c])}")
    verdict = judge(out_rows, clean, impl, failure_probability=failure_probability,
                    part_of=None if poisoned is None else (poisoned, kept))
    if not verdict.ok:
        return IsolationResult(False, f"{what}: clean rows differ from the reference without the "
                                      f"poisoned rows: {verdict.text}", verdict.ratio)
    return IsolationResult(True, f"{what}: clean rows within the judge ({verdict.text})", verdict.ratio)


def check_row_isolation(impl: Implementation, problem: Problem, rows: torch.Tensor, poison: str,
                        mode: str, *, seed: int = 0,
                        failure_probability: float = DEFAULT_FAILURE_PROBABILITY) -> IsolationResult:
    """Run ``impl`` on ``problem`` with ``rows`` poisoned (:func:`isolation_problems`) and judge
    the clean rows. Raises :class:`~magi_moe.judge.accuracy.InvalidProblem` when the clean problem's
    reference is not finite (no output can be judged)."""
    poisoned, clean, kept = isolation_problems(problem, rows, poison, mode, seed=seed)
    out = run_poisoned(impl, poisoned)
    what = f"{impl.name}: {int(rows.sum())} of {problem.num_tokens} rows {poison}, routes {mode}"
    result = _judge_rows(out[kept], kept, clean, impl, what, failure_probability, poisoned)
    if not result.ok:  # one root cause, one row: as inaccurate with no poison, accuracy's finding
        failure = judge(run_poisoned(impl, clean), clean, impl, failure_probability=failure_probability
                        ).failure(f"{what}: the clean rows are as wrong on their own, without the "
                                  f"poisoned rows: ")
        if isinstance(failure, Inaccurate):
            return IsolationResult(False, str(failure), result.ratio, failure)
    return result


def check_layer_row_isolation(impl: Implementation, config, state: dict, x: torch.Tensor,
                              rows: torch.Tensor, poison: str, *, seed: int = 0,
                              failure_probability: float = DEFAULT_FAILURE_PROBABILITY
                              ) -> IsolationResult:
    """``impl``'s own layer (``impl.layer(config, state)``) on ``x`` with ``rows`` poisoned: its
    clean rows must match the reference of the layer on the clean rows alone, routed by the
    implementation's router (``impl.route``) on those rows. ``state``: a released-layout state
    dict whose two router biases are equal (``audit.cache.draw_state``)."""
    from .cache import FRESHNESS_MODEL, selection_bias

    rows = _checked_rows(rows, x.shape[0], x.device)
    layer = impl.layer(config, state, x.device)
    kept = (~rows).nonzero().flatten()
    with torch.no_grad():
        y = layer(poison_rows(x, rows, poison, seed=seed))
    gate, bias = state["gate"].float(), selection_bias(state)
    x_clean = x[kept]
    got = impl.route(x_clean, gate, bias, config)
    routes = Routes(got.expert_ids.long(), got.probs.float())
    clean = Problem(config, x_clean, gate, bias, _weights(state, config), routes,
                    build_route_table(routes, config))
    what = f"{impl.name}.layer(): {int(rows.sum())} of {x.shape[0]} rows {poison}"
    # a layer returns x's dtype: the oracle's layer rounds its float64 result once, which the
    # plain model (the cache audit's) bounds
    model = impl if y.dtype == impl.output_dtype(x.dtype) else FRESHNESS_MODEL
    result = _judge_rows(y[kept], kept, clean, model, what, failure_probability)
    if not result.ok:
        with torch.no_grad():
            alone = judge(impl.layer(config, state, x.device)(x_clean), clean, model,
                          failure_probability=failure_probability)
        if not alone.ok:  # one root cause, one row: the clauses that judge a fresh layer say it
            raise LayerWrongOnItsOwn(f"{what}: the layer is as wrong on the clean rows alone, so "
                                     f"no poisoned row is to blame (see the checkpoint, routing "
                                     f"and accuracy rows): {alone.text.splitlines()[0]}")
    return result


def _weights(state: dict, config):
    from magi_moe.weights import ExpertWeights

    return ExpertWeights(*(state[n].detach().to(config.dtype) for n in ("W_gate", "W_up", "W_down")))
