"""Precision where it varies: an implementation whose fast path covers some widths and falls back
to plain PyTorch elsewhere declares which model holds where (``Implementation.precision_at``),
and the judge holds each shape to that model: the fallback is not a failure of the fast path's
contract, and the fast path is not let off with the fallback's looser bounds."""
from __future__ import annotations

import pytest
import torch

from magi_moe.judge import judge
from magi_moe.audit.probes import probe_problem
from magi_moe.config import preset
from magi_moe.implementation import Implementation
from magi_moe.problems import run_poisoned
from magi_moe.reference import expert_reference
from magi_moe.validation import check_out


def _fast_or_fallback(x, table, weights, config, *, out):
    """fp32 accumulation (the emulation of the fast paths) at head widths that are multiples of
    64; plain bf16 (every matmul result rounded) elsewhere, as a kernel's fallback would."""
    check_out(out, x)
    precision = "fp32acc" if config.head_dim % 64 == 0 else "bf16"
    return out.copy_(expert_reference(x, table, weights, config, precision=precision))


def _fallback_region(config):
    return "bf16-plain" if config.head_dim % 64 else None


DECLARED = Implementation("fallback-declared", _fast_or_fallback, ("cpu",), "bf16-fp32acc",
                          precision_at=_fallback_region)
UNDECLARED = Implementation("fallback-undeclared", _fast_or_fallback, ("cpu",), "bf16-fp32acc")
# claims the fast path's model where it really falls back, and the loose one where it is fast
INVERTED = Implementation("fallback-inverted", _fast_or_fallback, ("cpu",), "bf16-fp32acc",
                          precision_at=lambda c: None if c.head_dim % 64 else "bf16-plain")


def _swamp(head_dim: int):
    """The probe that exposes bf16 gate/up accumulation beyond the fp32acc worst case."""
    return probe_problem("swamp", preset("small").replace(head_dim=head_dim), 48, seed=11)


def test_the_model_follows_the_declared_region():
    assert DECLARED.precision_for(preset("tiny")) == "bf16-plain"          # Dh = 32
    assert DECLARED.precision_for(preset("small")) == "bf16-fp32acc"       # Dh = 64
    assert DECLARED.precision_for(None) == "bf16-fp32acc"


def test_a_declared_fallback_is_judged_by_its_own_model():
    for head_dim in (32, 64):
        problem = _swamp(head_dim)
        v = judge(run_poisoned(DECLARED, problem), problem, DECLARED)
        assert v.ok, v.text


def test_an_undeclared_fallback_fails_the_fast_model():
    """The negative control: without the declaration the fallback width fails (this is why the
    declaration exists), and the fast width passes."""
    problem = _swamp(32)
    v = judge(run_poisoned(UNDECLARED, problem), problem, UNDECLARED)
    assert not v.ok and "bf16-fp32acc" in v.text
    problem = _swamp(64)
    assert judge(run_poisoned(UNDECLARED, problem), problem, UNDECLARED).ok


def test_the_fast_path_is_not_let_off_by_a_loose_model_elsewhere():
    """Where the fast model is declared, the fast model's bounds apply: a declaration that puts
    the fallback under the fast model still fails there."""
    problem = _swamp(32)
    assert not judge(run_poisoned(INVERTED, problem), problem, INVERTED).ok


@pytest.mark.parametrize("returned, message", [
    ("fp64", "must return None or one of"),
    ("float64", "float64 only for the oracle"),
])
def test_a_bad_region_model_is_refused_naming_it(returned, message):
    impl = Implementation("bad-region", _fast_or_fallback, ("cpu",), "bf16-fp32acc",
                          precision_at=lambda c: returned)
    with pytest.raises(ValueError, match=message):
        impl.precision_for(preset("tiny"))


def test_precision_at_must_be_callable():
    with pytest.raises(ValueError, match="precision_at must be callable"):
        Implementation("bad", _fast_or_fallback, ("cpu",), "bf16-fp32acc", precision_at="bf16-plain")


def test_output_dtype_is_unchanged_by_regions():
    assert DECLARED.output_dtype(torch.bfloat16) == torch.bfloat16
