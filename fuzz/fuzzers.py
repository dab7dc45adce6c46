"""Each property paired with the strategy that feeds it: one place that says which cases and
parameters a property is fuzzed with, used by the tests, the broken-variant demonstrations and
``python -m fuzz replay``.

``case_strategy(prop, target, budget=...)`` draws ``(case, params)``; ``run(prop, target, case,
params)`` checks one; ``search(prop, target, settings=...)`` runs a whole Hypothesis search and
raises the (shrunk) violation it finds.
"""
from __future__ import annotations

from hypothesis import given, settings as Settings, strategies as st

from . import properties as P
from .strategies import expert_cases, huge_cases, tie_cases

__all__ = ["FUZZED_PROPERTIES", "case_strategy", "pytest_target", "run", "search"]

_seed = st.integers(0, 2**32 - 1)


def _expert(target, budget, **kw):
    """Cases inside what ``target`` declares: its dtypes and its shape rule."""
    if target is None:
        return expert_cases(budget=budget, **kw)
    return expert_cases(budget=budget, dtypes=target.dtypes, shapes=target.impl.shapes, **kw)


def _with(params: dict):
    """Pair a case strategy with a fixed-key dict of parameter strategies."""
    return lambda cases: st.tuples(cases, st.fixed_dictionaries(params))


def case_strategy(prop: str, target: P.Target | None = None, *, budget: float = 1.0):
    """``(case, params)`` for ``prop``; ``target`` narrows dtypes to what it declares."""
    if prop == "tie_rule":
        return _with({})(tie_cases(budget=budget))
    if prop == "huge_offsets":
        return _with({})(huge_cases(**({"shapes": target.impl.shapes} if target is not None else {})))
    if prop == "token_permutation":
        return _with({"perm_seed": _seed})(_expert(target, budget, min_tokens=1))
    if prop == "head_locality":
        return _with({"head": st.integers(0, 63), "seed": _seed})(_expert(target, budget))
    if prop == "empty_experts":
        return _with({})(_expert(target, budget, empty_banks=True, min_tokens=1))
    if prop == "deterministic":
        runs = max(3, round(2 + budget))
        return _with({"runs": st.just(runs)})(_expert(target, budget))
    if prop in ("differential", "linearity", "zero_tokens"):
        return _with({})(_expert(target, budget))
    raise ValueError(f"prop must be one of {FUZZED_PROPERTIES}, got {prop!r}")


FUZZED_PROPERTIES = tuple(P.PROPERTIES)


def run(prop: str, target, case, params: dict) -> dict:
    """Check one drawn case. ``target``: a :class:`~fuzz.properties.Target`, or for
    ``tie_rule`` a router spec (``package.module:attr``) with an optional ``device`` in params."""
    if prop == "tie_rule":
        router, device = (target, "cpu") if isinstance(target, str) else target
        return P.check_tie_rule(router, case, device=device, **params)
    return P.PROPERTIES[prop].check(target, case, **params)


def search(prop: str, target, *, settings: Settings, budget: float = 1.0) -> None:
    """Run a Hypothesis search of ``prop`` on ``target``; raises what it finds."""
    strategy_target = target if isinstance(target, P.Target) else None

    @settings
    @given(drawn=case_strategy(prop, strategy_target, budget=budget))
    def fuzz_one(drawn):
        case, params = drawn
        run(prop, target, case, params)

    fuzz_one()


def pytest_target(impl_backend, prop: str) -> P.Target:
    """The target of a test's ``impl_backend`` pair, or ``pytest.skip`` with the reason the
    property does not apply (the pair is missing, it would repeat ``@cpu``, a capability)."""
    import pytest

    if impl_backend is None:
        pytest.skip("no implementation/backend pair selected")
    target = P.target_for(impl_backend)
    if target.backend.name == "interpret" and "cpu" in target.impl.backends:
        pytest.skip(f"{target.impl.name} runs no Triton kernel: @interpret would repeat @cpu")
    why = target.skip_reason(P.PROPERTIES[prop].needs)
    if why:
        pytest.skip(why)
    return target
