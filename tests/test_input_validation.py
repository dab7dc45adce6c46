"""Error inputs, declared OpInfo-style as (how to break the input, exception, message pattern),
run against every implementation on every backend: each must raise a clear error naming the
argument, and none may crash the process or the GPU."""
import dataclasses

import pytest
import torch

from magi_moe.config import preset
from magi_moe.problems import random_problem
from magi_moe.routing import validate_route_table
from magi_moe.tests.second_device import other_device

pytestmark = pytest.mark.kernels_only


def _table(p, **changes):
    return dataclasses.replace(p.table, **changes)


def _weights(p, **changes):
    return p.weights._replace(**changes)


# (id, make bad (x, table, weights) from a valid problem, exception, message pattern)
# Patterns may name the problem's config ({hidden}, {head_dim}, {inter}, {dtype}): each
# implementation runs at the nearest config its declaration accepts.
ERROR_INPUTS = [
    ("x-rank-3", lambda p: (p.x[None], p.table, p.weights), ValueError, "x must have rank 2"),
    ("x-width", lambda p: (p.x[:, :-16], p.table, p.weights), ValueError, r"x must have shape \[12, {hidden}\]"),
    ("x-tokens", lambda p: (p.x[:-1], p.table, p.weights), ValueError, r"x must have shape \[12, {hidden}\]"),
    ("x-int", lambda p: (p.x.to(torch.int32), p.table, p.weights), ValueError, "x must have dtype"),
    ("x-not-tensor", lambda p: (p.x.tolist(), p.table, p.weights), TypeError, "x must be a torch.Tensor"),
    ("w_up-shape", lambda p: (p.x, p.table, _weights(p, w_up=p.weights.w_up[:, :, :-16])),
     ValueError, r"w_up must have shape \[16, {head_dim}, {inter}\]"),
    ("w_down-dtype", lambda p: (p.x, p.table, _weights(p, w_down=p.weights.w_down.to(_other(p.x.dtype)))),
     ValueError, "w_down must have dtype {dtype}"),
    ("gather-out-of-range", lambda p: (p.x, _table(p, gather_ids=p.table.gather_ids + 5), p.weights),
     ValueError, r"table.gather_ids must lie in \[0, 12\)"),
    ("gather-negative", lambda p: (p.x, _table(p, gather_ids=p.table.gather_ids - 100), p.weights),
     ValueError, r"table.gather_ids must lie in \[0, 12\)"),
    ("offsets-end", lambda p: (p.x, _table(p, offsets=p.table.offsets * 2), p.weights),
     ValueError, "table.offsets must start at 0 and end at the route count 48"),
    ("offsets-decreasing", lambda p: (p.x, _table(p, offsets=_swap_offsets(p.table.offsets)), p.weights),
     ValueError, "table.offsets must be non-decreasing"),
    ("slots-out-of-range", lambda p: (p.x, _table(p, route_slots=p.table.route_slots + 1000), p.weights),
     ValueError, r"table.route_slots must lie in \[0, 48\)"),
    ("offsets-int32", lambda p: (p.x, _table(p, offsets=p.table.offsets.int()), p.weights),
     ValueError, "table.offsets must have dtype int64"),
    ("probs-length", lambda p: (p.x, _table(p, sorted_probs=p.table.sorted_probs[:-1]), p.weights),
     ValueError, "sorted_probs must have"),
]


def _other(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype != torch.float16 else torch.bfloat16


def _problem(impl, device):
    """The error inputs' valid problem, at the nearest config ``impl`` declares."""
    return random_problem(impl.fit(preset("tiny")), 12, seed=0, device=device)


def _expected(pattern: str, config) -> str:
    return pattern.format(hidden=config.hidden_size, head_dim=config.head_dim,
                          inter=config.intermediate_size,
                          dtype=str(config.dtype).removeprefix("torch."))


def _swap_offsets(offsets):
    bad = offsets.clone()
    nonzero = torch.nonzero(bad[1:-1] > 0).flatten()
    i = int(nonzero[0]) + 1
    bad[i] = bad[-1]  # jump up then down again
    return bad


@pytest.mark.parametrize("make_bad,exc,pattern", [pytest.param(*e[1:], id=e[0]) for e in ERROR_INPUTS])
@pytest.mark.clause("input-checks")
@pytest.mark.needs("input_checks")
def test_bad_inputs_raise_clear_errors(impl_backend, make_bad, exc, pattern):
    problem = _problem(impl_backend.impl, impl_backend.device)
    x, table, weights = make_bad(problem)
    with pytest.raises(exc, match=_expected(pattern, problem.config)):
        impl_backend.impl(x, table, weights, problem.config)


@pytest.mark.clause("input-checks")
@pytest.mark.needs("input_checks")
def test_mismatched_devices_are_named(impl_backend):
    other = other_device(impl_backend.device)
    problem = _problem(impl_backend.impl, impl_backend.device)
    with pytest.raises(ValueError, match="one device"):
        impl_backend.impl(problem.x, problem.table, problem.weights.to(other), problem.config)


def _duplicate_slot(table):
    slots = table.route_slots.clone()
    slots[1] = slots[0]
    return dataclasses.replace(table, route_slots=slots)


def _infinite_prob(table):
    probs = table.sorted_probs.clone()
    probs[0] = float("inf")
    return dataclasses.replace(table, sorted_probs=probs)


# (make a bad table from a valid one, config changes, message pattern); all ValueError. In range
# everywhere, so only the full validation sees them.
INCONSISTENT_TABLES = [
    pytest.param(_duplicate_slot, {}, "route_slots must be distinct", id="duplicate-slot"),
    pytest.param(lambda t: dataclasses.replace(t, gather_ids=t.gather_ids.flip(0)), {},
                 "disagree with table.gather_ids", id="gather_ids-reversed"),
    pytest.param(_infinite_prob, {}, "sorted_probs must be finite", id="probs-infinite"),
    pytest.param(lambda t: t, {"top_k": 3}, "table was built for", id="config-top_k"),
]


def test_full_table_validation_accepts_a_built_table():
    """The control for the rows below."""
    cfg = preset("tiny")
    validate_route_table(random_problem(cfg, 12, seed=0).table, cfg)


@pytest.mark.parametrize("make_bad, config_changes, pattern", INCONSISTENT_TABLES)
def test_full_table_validation_catches_inconsistent_hand_built_tables(make_bad, config_changes,
                                                                      pattern):
    cfg = preset("tiny")
    table = random_problem(cfg, 12, seed=0).table
    with pytest.raises(ValueError, match=pattern):
        validate_route_table(make_bad(table), cfg.replace(**config_changes))
