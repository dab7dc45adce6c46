"""The checks every implementation (and router) must pass, as plain functions of (target, case).

Each check builds the case's tensors, runs the implementation into a NaN-poisoned output, and
raises :class:`~fuzz.record.PropertyViolation` (whose message ends with a one-line reproduction
command) when the property fails; it returns a dict of metrics otherwise. Each is declared once,
with the strategy that feeds it, as a :class:`~fuzz.fuzzers.Property` record in
:data:`fuzz.fuzzers.PROPERTIES`, which the tests, the campaign runner and ``python -m fuzz
replay`` read.

``python -m fuzz list`` prints them, one line each (the first sentence of each check's docstring).
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import currently_in_test_context, event, note, reject, target as hyp_target

from magi_moe.audit import isolation
from magi_moe.judge.bounds import problem_bounds
from magi_moe.judge.accuracy import InvalidProblem, judge
from magi_moe.audit.router_judge import RouterVerdict, judge_router, judge_router_call
from magi_moe.backends import Backend, get_backend
from magi_moe.problems import Problem, run_poisoned
from magi_moe.registry import Implementation, get_implementation
from magi_moe.routing import Routes, build_route_table
from magi_moe.verdict import LayerWrongOnItsOwn

from .cases import (ExpertCase, HugeCase, TieCase, build_problem, build_router_inputs, cancelling_problem,
                    case_to_dict, drop_banks)
from .huge import run_isolated
from .record import PropertyViolation, in_flight
from .tolerance import CAMPAIGN_FAILURE_PROBABILITY, order_mismatch

__all__ = [
    "EXERCISED", "TALLY", "VACUOUS", "RouterTarget", "Target", "check_deterministic",
    "check_differential", "check_empty_experts", "check_head_locality", "check_huge_offsets",
    "check_linearity", "check_routing", "check_row_isolation", "check_tie_rule",
    "check_token_permutation", "check_zero_tokens", "linearity_on", "load_router", "make_router_target",
    "make_target", "spec_for", "target_for",
]

# Every example says whether it could have failed: "vacuous" when the drawn case leaves nothing
# to check (one token to permute, one head to isolate, nothing to double). The strategies are
# built to draw none of those; the per-commit test asserts it from this tally.
EXERCISED, VACUOUS = "exercised", "vacuous"
TALLY: Counter = Counter()  # (property, EXERCISED or VACUOUS) -> examples, in this process


@dataclass(frozen=True)
class Target:
    """The implementation under test on one backend. ``spec`` is how a replay loads it: a
    registered name or ``package.module:attr``."""

    impl: Implementation
    backend: Backend
    spec: str

    @property
    def device(self) -> str:
        return self.backend.device

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(d for d in self.impl.dtypes if d in (torch.bfloat16, torch.float16, torch.float32))

    def skip_reason(self, needs: tuple[str, ...] = ()) -> str | None:
        return self.impl.skip_reason(self.backend, needs=needs)


def make_target(impl: str | Implementation, backend: str | Backend, *, spec: str | None = None) -> Target:
    """``impl``: a registered name, ``package.module:attr``, or an Implementation (then give
    ``spec``, the string that loads it again, or it must be registered under its name)."""
    if isinstance(impl, str):
        spec, impl = spec or impl, get_implementation(impl)
    elif not isinstance(impl, Implementation):
        raise TypeError(f"impl must be a name or an Implementation, got {type(impl).__name__}")
    backend = get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a name or a Backend, got {type(backend).__name__}")
    return Target(impl, backend, spec or impl.name)


@dataclass(frozen=True)
class RouterTarget:
    """A router ``route(x, gate, bias, config) -> Routes`` under test on one backend. ``spec``
    (``package.module:attr``) is how a replay loads it; ``name`` labels it in test ids."""

    spec: str
    backend: Backend
    name: str = ""

    @property
    def device(self) -> str:
        return self.backend.device

    def skip_reason(self, needs: tuple[str, ...] = ()) -> str | None:
        return self.backend.skip_reason()

    def __str__(self) -> str:
        return f"{self.name or self.spec}@{self.backend.name}"


def make_router_target(spec: str, backend: str | Backend = "cpu", *, name: str = "") -> RouterTarget:
    """``spec``: ``package.module:attr`` of a router; ``backend``: a name or a Backend."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"router must look like 'package.module:attr', got {spec!r}")
    backend = get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a name or a Backend, got {type(backend).__name__}")
    return RouterTarget(spec, backend, name)


def spec_for(impl: Implementation) -> str:
    """How a fresh process loads ``impl``: its registered name for a built-in, else the
    ``package.module:attr`` of a module that holds it (outside and deliberately broken
    implementations)."""
    import sys

    from magi_moe.impls import BUILTINS

    if any(impl is b for b in BUILTINS):
        return impl.name
    known = _SPECS.get(id(impl))
    if known is not None and known[0] is impl:
        return known[1]
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name == "__main__":
            continue
        attr = next((a for a, v in list(getattr(module, "__dict__", {}).items())
                     if v is impl and not a.startswith("_")), None)
        if attr is not None:
            found.append(f"{module_name}:{attr}")
    # pytest may import tests/x.py both as "x" and "tests.x": the dotted path loads from the root
    spec = max(found, key=lambda f: (f.count("."), f)) if found else impl.name
    _SPECS[id(impl)] = (impl, spec)
    return spec


_SPECS: dict[int, tuple[Implementation, str]] = {}


def target_for(pair) -> Target:
    """The target of a test's ``impl_backend`` pair (tests/conftest.py's ImplOnBackend)."""
    return Target(pair.impl, pair.backend, spec_for(pair.impl))


def load_router(spec: str) -> Callable[..., Routes]:
    """A router ``route(x, gate, bias, config) -> Routes`` named ``package.module:attr``."""
    import importlib
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"router must look like 'package.module:attr', got {spec!r}")
    return getattr(importlib.import_module(module), attr)


# -- helpers ---------------------------------------------------------------------------------------
def _record(prop: str, target: Target, case, **params) -> dict:
    return {"property": prop, "impl": target.spec, "backend": target.backend.name,
            "case": case_to_dict(case), "params": params}


def _push(ratio: float, label: str) -> None:
    if currently_in_test_context() and math.isfinite(ratio):
        hyp_target(ratio, label=label)


def _note(text: str) -> None:
    if currently_in_test_context():
        note(text)


def _require_written(out: torch.Tensor, record: dict, what: str = "output") -> None:
    """Every element written: the harness poisons outputs and workspaces with NaN."""
    bad = torch.isnan(out)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise PropertyViolation(f"{int(bad.sum())} of {out.numel()} {what} elements are NaN "
                                f"(unwritten or poisoned workspace), first at {first}", record)


def _exercised(prop: str, vacuous_because: str | None = None) -> None:
    """Count this example in :data:`TALLY`, and label it for Hypothesis' statistics."""
    TALLY[(prop, VACUOUS if vacuous_because else EXERCISED)] += 1
    if currently_in_test_context():
        event(f"{prop}: vacuous ({vacuous_because})" if vacuous_because else f"{prop}: exercised")


def _accumulate_dtype(impl: Implementation) -> torch.dtype:
    return torch.float64 if impl.is_oracle else torch.float32


def _run(target: Target, problem: Problem) -> torch.Tensor:
    return run_poisoned(target.impl, problem)


def _order_slack(target: Target, problem: Problem) -> torch.Tensor:
    """The worst-case error bound of ``target``'s result on ``problem`` (float64 ``[S, H*Dh]``):
    how far any summation order may move it from the exact value."""
    model = target.impl.precision_for(problem.config)
    return problem_bounds(problem, model, failure_probability=CAMPAIGN_FAILURE_PROBABILITY).worst


def _first_mismatch(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> str:
    idx = mask.nonzero()[0].tolist()
    return (f"{int(mask.sum())} of {mask.numel()} elements differ, first at {idx}: "
            f"{float(a[tuple(idx)]):.6g} vs {float(b[tuple(idx)]):.6g}")


def _differential(target: Target, problem: Problem, out: torch.Tensor, record: dict, label: str) -> dict:
    try:
        verdict = judge(out, problem, target.impl, failure_probability=CAMPAIGN_FAILURE_PROBABILITY)
    except InvalidProblem as exc:
        # The strategies keep inputs finite; an overflowing oracle means the case is invalid.
        if currently_in_test_context():
            reject()
        raise ValueError(f"invalid case: {exc} ({record['case']})") from None
    _push(verdict.ratio, label)
    _note(f"{label}: {verdict.text}")
    if not verdict.ok:
        raise PropertyViolation(f"inaccurate: {verdict.text}", record, verdict.metrics) \
            from verdict.failure()  # typed: the verdict counts an inaccuracy under accuracy
    return {"ratio": verdict.ratio, "decided_by": verdict.criterion}


# -- the properties -----------------------------------------------------------------------------------
def check_differential(target: Target, case: ExpertCase) -> dict:
    """Agreement with the float64 oracle on the same routes, within the audited bound; every
    output element written. (The bound: :mod:`fuzz.tolerance`; the error ratio is pushed up
    with ``hypothesis.target``.)"""
    record = _record("differential", target, case)
    with in_flight(record):
        problem = build_problem(case, target.device)
        out = _run(target, problem)
        _require_written(out, record)
        _exercised("differential", None if case.num_tokens else "no tokens")
        return _differential(target, problem, out, record, "error/bound")


def check_token_permutation(target: Target, case: ExpertCase, *, perm_seed: int) -> dict:
    """Permuting the tokens (and their routes) permutes the output rows, within rounding."""
    record = _record("token_permutation", target, case, perm_seed=perm_seed)
    with in_flight(record):
        p = build_problem(case, target.device)
        S = case.num_tokens
        perm = torch.randperm(S, generator=torch.Generator().manual_seed(perm_seed))
        if S > 1 and bool((perm == torch.arange(S)).all()):
            perm = perm.roll(1)  # the identity would compare the output with itself
        perm = perm.to(p.x.device)
        _exercised("token_permutation", None if S > 1 else "fewer than two tokens")
        routes = Routes(p.routes.expert_ids[perm], p.routes.probs[perm])
        table = drop_banks(build_route_table(routes, case.config), case.empty_banks)
        permuted = Problem(case.config, p.x[perm], p.gate, p.bias, p.weights, routes, table)
        out = _run(target, p)
        out_perm = _run(target, permuted)
        _require_written(out, record)
        _require_written(out_perm, record, "permuted output")
        slack = lambda: _order_slack(target, permuted) + _order_slack(target, p)[perm]  # noqa: E731
        bad = order_mismatch(out_perm, out[perm], slack, out_dtype=case.config.dtype,
                             accumulate_dtype=_accumulate_dtype(target.impl))
        if bool(bad.any()):
            raise PropertyViolation("permuting tokens did not permute the output: "
                                    + _first_mismatch(bad, out_perm, out[perm]), record)
        return {"tokens": S}


def check_head_locality(target: Target, case: ExpertCase, *, head: int, seed: int) -> dict:
    """A head's output depends only on its own slice of x, bank and routes: redrawing everything
    outside ``head`` must not move ``head``'s output."""
    cfg = case.config
    head = head % cfg.num_heads
    record = _record("head_locality", target, case, head=head, seed=seed)
    with in_flight(record):
        p = build_problem(case, target.device)
        H, E, K, Dh = cfg.num_heads, cfg.num_experts, cfg.top_k, cfg.head_dim
        gen = torch.Generator().manual_seed(seed)
        others = [h for h in range(H) if h != head]
        _exercised("head_locality", "one head" if not others else None if case.num_tokens else "no tokens")
        x = p.x.clone()
        ids, probs = p.routes.expert_ids.clone(), p.routes.probs.clone()
        weights = [w.clone() for w in p.weights]
        S = case.num_tokens
        for h in others:
            cols = slice(h * Dh, (h + 1) * Dh)
            x[:, cols] = (x[:, cols].float().flip(0) * 0.5
                          + torch.randn(S, Dh, generator=gen).to(x.device)).to(x.dtype)
            banks = slice(h * E, (h + 1) * E)
            for w in weights:
                w[banks] = (w[banks].float() * -1.5).to(w.dtype)
            keys = torch.rand(S, E, generator=gen)
            ids[:, h] = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :K].to(ids.device)
            probs[:, h] = torch.rand(S, K, generator=gen).to(probs.device)
        routes = Routes(ids, probs)
        table = drop_banks(build_route_table(routes, cfg), case.empty_banks)
        other = Problem(cfg, x, p.gate, p.bias, type(p.weights)(*weights), routes, table)
        out, out_other = _run(target, p), _run(target, other)
        _require_written(out, record)
        _require_written(out_other, record, "perturbed output")
        cols = slice(head * Dh, (head + 1) * Dh)
        slack = lambda: (_order_slack(target, other) + _order_slack(target, p))[:, cols]  # noqa: E731
        bad = order_mismatch(out_other[:, cols], out[:, cols], slack, out_dtype=cfg.dtype,
                             accumulate_dtype=_accumulate_dtype(target.impl))
        if bool(bad.any()):
            raise PropertyViolation(f"head {head}'s output changed when only other heads' inputs, "
                                    "banks and routes changed: "
                                    + _first_mismatch(bad, out_other[:, cols], out[:, cols]), record)
        return {"head": head}


def check_linearity(target: Target, case: ExpertCase) -> dict:
    """Doubling every routing weight doubles the output: exactly for the float64 oracle
    (doubling never rounds), within rounding for every other path. A locality check: a
    "deterministic" path whose sum order races between the two calls is the determinism
    clause's finding, not this one's."""
    record = _record("linearity", target, case)
    with in_flight(record):
        return linearity_on(target, build_problem(case, target.device), record)


def linearity_on(target: Target, p: Problem, record: dict | None = None) -> dict:
    """:func:`check_linearity` on a problem built by hand (``cancelling_problem``, say);
    ``record``: the failure record (default: one naming no case)."""
    if record is None:
        record = {"property": "linearity", "impl": target.spec, "backend": target.backend.name,
                  "case": None, "params": {}}
    limit = torch.finfo(p.config.dtype).max / 4
    doubled_table = dataclasses.replace(p.table, sorted_probs=p.table.sorted_probs * 2)
    doubled = Problem(p.config, p.x, p.gate, p.bias, p.weights, p.routes, doubled_table)
    out, out2 = _run(target, p), _run(target, doubled)
    _require_written(out, record)
    _require_written(out2, record, "doubled output")
    if out.numel() and float(out.double().abs().max()) > limit:
        _exercised("linearity", "output near the dtype's range")
        return {"skipped": "near overflow"}
    _exercised("linearity", None if bool((out != 0).any()) else "an all-zero output")
    twice = out.double() * 2  # exact: doubling a finite float never rounds below overflow
    exact = target.impl.is_oracle
    if exact:
        # Exact only for normal numbers: below the dtype's smallest normal the grid spacing is
        # fixed, so round(2v) and 2 round(v) may differ by one subnormal step.
        info = torch.finfo(out.dtype)
        # (<=: a value just below the smallest normal may round up to it)
        subnormal = twice.abs() <= 2 * info.tiny
        one_step = (out2.double() - twice).abs() <= info.smallest_normal * info.eps
        bad = (out2.double() != twice) & ~(subnormal & one_step)
    else:
        slack = lambda: _order_slack(target, doubled) + 2 * _order_slack(target, p)  # noqa: E731
        bad = order_mismatch(out2, twice, slack, out_dtype=p.config.dtype,
                             accumulate_dtype=_accumulate_dtype(target.impl))
    if bool(bad.any()):
        how = "exactly" if exact else "within rounding"
        raise PropertyViolation(f"doubling the routing weights did not double the output {how}: "
                                + _first_mismatch(bad, out2.double(), twice), record)
    return {"exact": exact}


def _routed_pairs(table, num_tokens: int, num_heads: int, top_k: int) -> torch.Tensor:
    """Boolean ``[S, H]``: does (token, head) keep at least one route?"""
    has = torch.zeros(num_tokens * num_heads, dtype=torch.bool, device=table.route_slots.device)
    has[table.route_slots // top_k] = True
    return has.view(num_tokens, num_heads)


def _with_a_routed_bank_emptied(case: ExpertCase, p: Problem) -> tuple[ExpertCase, Problem]:
    """``(case, p)``, with the busiest bank added to the emptied ones when none of them held a
    route (``p``: the case's problem; its values are kept, only its table changes)."""
    if p.table.num_routes < p.routes.expert_ids.numel() or not p.table.num_routes:
        return case, p  # a drawn bank held routes, or there are none to drop
    full = p.table  # nothing was dropped: the case's table is the full one
    busiest = int(full.offsets.diff().argmax())
    case = dataclasses.replace(case, empty_banks=case.empty_banks + (busiest,))
    return case, dataclasses.replace(p, table=drop_banks(full, case.empty_banks))


def check_empty_experts(target: Target, case: ExpertCase) -> dict:
    """(token, head) pairs whose experts were all emptied by hand give exactly zero, and the
    rest still agree with the oracle. When the drawn banks hold no route (likely with many
    banks and few tokens), the busiest bank is emptied too, so that every case can fail; the
    record names the banks emptied, so a replay is exact."""
    cfg = case.config
    record = _record("empty_experts", target, case)
    with in_flight(record):
        case, p = _with_a_routed_bank_emptied(case, build_problem(case, target.device))
        record.update(_record("empty_experts", target, case))  # the banks emptied, for a replay
        out = _run(target, p)
        _require_written(out, record)
        S, H, Dh = case.num_tokens, cfg.num_heads, cfg.head_dim
        unrouted = ~_routed_pairs(p.table, S, H, cfg.top_k)
        per_pair = out.view(S, H, Dh)
        nonzero = unrouted[:, :, None] & (per_pair != 0)
        if bool(nonzero.any()):
            s, h, d = nonzero.nonzero()[0].tolist()
            raise PropertyViolation(
                f"token {s} head {h} has no route (banks {list(case.empty_banks)} emptied) but its "
                f"output is nonzero: y[{s}, {h * Dh + d}] = {float(per_pair[s, h, d]):.6g} "
                f"({int(nonzero.any(-1).sum())} such (token, head) pairs)", record)
        dropped = p.routes.expert_ids.numel() - p.table.num_routes  # every route is S*H*K
        _exercised("empty_experts", None if dropped else "the emptied banks had no routes")
        metrics = _differential(target, p, out, record, "empty-experts error/bound")
        metrics["unrouted_pairs"] = int(unrouted.sum())
        return metrics


def check_zero_tokens(target: Target, case: ExpertCase) -> dict:
    """Zero tokens, and the same layer with every expert empty: nothing to do, exactly zeros."""
    cfg = case.config
    record = _record("zero_tokens", target, case)
    with in_flight(record):
        for sub, what in ((dataclasses.replace(case, num_tokens=0, empty_banks=()), "zero tokens"),
                          (dataclasses.replace(case, empty_banks=tuple(range(cfg.num_banks))), "all experts empty")):
            p = build_problem(sub, target.device)
            out = _run(target, p)
            if tuple(out.shape) != (sub.num_tokens, cfg.hidden_size):
                raise PropertyViolation(f"{what}: output shape {tuple(out.shape)}, expected "
                                        f"{(sub.num_tokens, cfg.hidden_size)}", record)
            _require_written(out, record, f"{what} output")
            if bool((out != 0).any()):
                raise PropertyViolation(f"{what}: output is not all zero (max |y| = "
                                        f"{float(out.abs().max()):.6g})", record)
        _exercised("zero_tokens")
        return {}


def check_deterministic(target: Target, case: ExpertCase, *, runs: int = 3) -> dict:
    """Bitwise identical output run after run, and (on the CPU) with one thread or several."""
    record = _record("deterministic", target, case, runs=runs)
    with in_flight(record):
        p = build_problem(case, target.device)
        first = _run(target, p)
        _require_written(first, record)
        threads = torch.get_num_threads()
        settings = [threads] * max(1, runs - 1) + ([1] if target.device == "cpu" and threads > 1 else [])
        for i, n in enumerate(settings):
            torch.set_num_threads(n)
            try:
                again = _run(target, p)
            finally:
                torch.set_num_threads(threads)
            same = (again == first) | (torch.isnan(again) & torch.isnan(first))
            if not bool(same.all()):
                raise PropertyViolation(f"run {i + 2} (threads={n}) differs bitwise from run 1: "
                                        + _first_mismatch(~same, again, first), record)
        # The same reruns on top-k sums that cancel, where a changing summation order shows.
        cancelling = cancelling_problem(case.config, max(16, case.num_tokens), seed=case.values.seed,
                                        device=target.device)
        cancels = target.impl.supports(cancelling.config) is None
        _exercised("deterministic", None if case.num_tokens or cancels else "no tokens")
        if cancels:
            first = _run(target, cancelling)
            for i in range(max(1, runs - 1)):
                again = _run(target, cancelling)
                same = (again == first) | (torch.isnan(again) & torch.isnan(first))
                if not bool(same.all()):
                    raise PropertyViolation(
                        f"run {i + 2} on top-k sums that cancel (fuzz.cases.cancelling_problem) "
                        "differs bitwise from run 1: " + _first_mismatch(~same, again, first), record)
        return {"runs": len(settings) + 1}


def _layer_state(p: Problem) -> dict[str, torch.Tensor]:
    """A released-layout state dict of the problem's tensors (both router biases equal)."""
    cfg = p.config
    bias = p.bias if p.bias is not None else torch.zeros(cfg.num_banks, device=p.x.device)
    return {"gate": p.gate.float(), "W_gate": p.weights.w_gate, "W_up": p.weights.w_up,
            "W_down": p.weights.w_down, "router.expert_bias": bias.float().clone(),
            "router.expert_bias_ema": bias.float().clone()}


def check_row_isolation(target: Target, case: ExpertCase, *, poison: str, routes: str, form: str,
                        poison_seed: int, padding: bool = False) -> dict:
    """Rows poisoned with NaN, Inf or overflowing garbage never reach other tokens' outputs: the
    clean rows agree, within the accuracy judge and finite, with the float64 reference of the
    clean rows alone (same routes). ``routes``: the poisoned rows get none (``unrouted``), keep
    theirs (``own``) or share a clean row's (``shared``, where a per-expert amax spreads NaN);
    ``form``: the expert ``kernel`` on given routes, or the implementation's own ``layer``
    (routing included); ``padding``: the poisoned rows are the last ones (padding rows), else
    scattered. See :mod:`audit.isolation`."""
    record = _record("row_isolation", target, case, poison=poison, routes=routes, form=form,
                     poison_seed=poison_seed, padding=padding)
    with in_flight(record):
        p = build_problem(case, target.device)
        rows = isolation.poisoned_rows(case.num_tokens, seed=poison_seed, padding=padding)
        vacuous = None if case.num_tokens > 1 else "fewer than two tokens"
        if currently_in_test_context():
            event(f"row_isolation: {form}, {poison}, {'padding' if padding else 'scattered'} rows"
                  + (f", routes {routes}" if form == "kernel" else ""))
        try:
            if form == "layer":
                result = isolation.check_layer_row_isolation(
                    target.impl, case.config, _layer_state(p), p.x, rows, poison, seed=poison_seed,
                    failure_probability=CAMPAIGN_FAILURE_PROBABILITY)
            else:
                result = isolation.check_row_isolation(
                    target.impl, p, rows, poison, routes, seed=poison_seed,
                    failure_probability=CAMPAIGN_FAILURE_PROBABILITY)
        except LayerWrongOnItsOwn as exc:  # the checkpoint, routing and accuracy clauses say it
            _exercised("row_isolation", "the layer is wrong on the clean rows alone")
            _note(str(exc))
            return {"skipped": "the layer is wrong on its own"}
        except InvalidProblem as exc:  # the clean rows' reference overflows: nothing to judge
            if currently_in_test_context():
                reject()
            raise ValueError(f"invalid case: {exc} ({record['case']})") from None
        _exercised("row_isolation", vacuous)
        _push(result.ratio, "row-isolation error/bound")
        _note(result.text)
        if not result.ok and result.inaccurate is not None:  # wrong with no poison too: accuracy's
            raise PropertyViolation(f"the clean rows are inaccurate: {result.text}", record) from result.inaccurate
        if not result.ok:
            raise PropertyViolation(f"a poisoned row reached another token: {result.text}", record)
        return {"ratio": result.ratio, "poisoned_rows": int(rows.sum())}


def _require_routes(verdict: RouterVerdict, record: dict) -> dict:
    """The router judge's verdict (:mod:`audit.router_judge`) as a property: a violation names
    the broken rules; near-ties are reported as an event."""
    if verdict.near_ties:
        event(f"{record['property']}: near-tie disagreements with float64 (reported, not failures)")
    if not verdict.ok:
        raise PropertyViolation(f"routes break {', '.join(verdict.failed)}: {verdict.text}", record,
                                verdict.metrics)
    return {"near_ties": verdict.near_ties}


def check_tie_rule(router: RouterTarget, case: TieCase) -> dict:
    """magi-moe's routers judged against the float64 router: exact ties to the lower index,
    first; NaN last; bias in the choice only; L1 normalisation with eps; route_scale
    (:func:`audit.router_judge.judge_router`). A router that returns its own route table must
    also match it."""
    if not isinstance(router, RouterTarget):
        raise TypeError(f"router must be a RouterTarget (make_router_target), got {type(router).__name__}")
    cfg = case.config
    record = {"property": "tie_rule", "router": router.spec, "backend": router.backend.name,
              "case": case_to_dict(case), "params": {}}
    with in_flight(record):
        route_fn = load_router(router.spec)
        x, gate, bias = build_router_inputs(case, router.device)
        routes = route_fn(x, gate, bias, cfg)
        _exercised("tie_rule", None if case.num_tokens else "no tokens")
        metrics = _require_routes(judge_router(routes, x, gate, bias, cfg, subject=str(router)), record)
        if getattr(routes, "table", None) is not None:
            _check_own_table(routes, cfg, record)
        return metrics


def check_routing(target: Target, case: TieCase, *, head: int) -> dict:
    """The implementation's own router judged against the float64 router like the tie rule's,
    plus head locality. ``impl.route`` is its declared ``router``, else magi-moe's; ``head``'s
    routes must stay put when every other head's inputs are redrawn."""
    cfg = case.config
    record = _record("routing", target, case, head=head)
    why = target.impl.supports(cfg)
    _exercised("routing", why and "unsupported shape" or (None if case.num_tokens else "no tokens"))
    if why:
        return {"unsupported": why}
    with in_flight(record):
        x, gate, bias = build_router_inputs(case, target.device)
        verdict = judge_router_call(target.impl.route, x, gate, bias, cfg, heads=(head,),
                                    subject=f"{target.impl.name}.route")
        return _require_routes(verdict, record)


def _check_own_table(routes, cfg, record: dict) -> None:
    """A router that also returns the route table it built (the fused router builds it on the
    device, and the expert kernels read it): it must be ``build_route_table`` of its own choices,
    field for field. Ties and NaN are where a device-built table can count a route twice or not
    at all while every choice is right (the fused router once counted a NaN key equal to the 'taken' sentinel)."""
    want = build_route_table(Routes(routes.expert_ids.long(), routes.probs), cfg)
    # NaN weights (NaN rows of x) are right where both tables hold them; torch.equal never
    # matches NaN, so both are read with NaN as -inf, a weight no router may return (the
    # router judge has failed such a weight already)
    def nan_as_minus_inf(table):
        return dataclasses.replace(table, sorted_probs=torch.nan_to_num(
            table.sorted_probs, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")))
    difference = nan_as_minus_inf(routes.table).first_difference(nan_as_minus_inf(want))
    if difference is not None:
        raise PropertyViolation(f"the router's own route table is not the table of its choices: "
                                f"{difference}", record)


def check_huge_offsets(target: Target, case: HugeCase, *, timeout: float = 600) -> dict:
    """Tokens past 2^31 / row stride, in a child process: through the implementation's declared
    launcher (a caller-owned accumulator), else through its forward (real output memory).
    A shape outside the implementation's ``supports`` is reported, not run; so is a child that
    ran out of memory (``needs more than N GiB at this case``): a resource limit, not a finding.
    A wild read (SIGSEGV, SIGBUS, a CUDA illegal address) is the offset finding; a timeout and
    any other death are failures of their own (:mod:`fuzz.child`)."""
    record = _record("huge_offsets", target, case)
    why = target.impl.supports(case.config)
    if why:
        _exercised("huge_offsets", "unsupported shape")
        return {"unsupported": why}
    mode = "launcher" if target.impl.launcher is not None else "forward"
    with in_flight(record):
        result = run_isolated(case, backend=target.backend.name, impl=target.spec, mode=mode,
                              timeout=timeout)
        end, where = result.end, (f"tokens {list(case.tokens)} of {case.num_tokens}, row stride "
                                  f"{case.config.hidden_size}")
        _exercised("huge_offsets", "the child ran out of memory" if end.kind == "memory" else None)
        if end.kind == "memory":
            return {"unsupported": f"{target.impl.name} {end.text}", "end": end.kind}
        if end.kind == "wild_read":
            raise PropertyViolation(f"{end.text} ({where}): an int32 offset overflow reads a wild "
                                    "address", record, {"end": end.kind, "signal": result.signal_name})
        if end.kind != "exited":
            raise PropertyViolation(f"{end.text} ({where}); not an offset finding: "
                                    f"{result.output_tail[-800:]}", record, {"end": end.kind})
        if result.result and not result.result["ok"]:
            raise PropertyViolation(f"wrong rows past 2^31: {result.result['describe']}; guard rows "
                                    f"intact: {result.result['guard_ok']}", record, result.result)
        if result.returncode != 0 or not result.result:
            raise PropertyViolation(f"the child process exited with {result.returncode} on a shape "
                                    f"{target.impl.name} supports: {result.output_tail[-1500:]}", record)
        return result.result
