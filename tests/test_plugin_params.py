"""The implementation matrix of magi-moe's pytest plugin (magi_moe.pytest_plugin): rows only for
what an implementation declares (dtypes, backends), one skipped row for a pair that cannot run
here, and the ids ``-k`` selects by."""
from __future__ import annotations

import pytest
import torch

from magi_moe.backends import BACKENDS
from magi_moe.impls import FUSED, NATIVE, TORCH_BF16
from magi_moe.pytest_plugin import impl_backend_params, impl_dtype_params


class Options:
    """What ``impl_backend_params`` reads from a pytest config: ``--impl`` and ``--backend``."""

    def __init__(self, impls: list[str], backends: list[str]):
        self.options = {"--impl": impls, "--backend": backends}

    def getoption(self, name):
        return self.options[name]


def rows(params) -> list[tuple[str, tuple, bool]]:
    return [(p.id, p.values, any(m.name == "skip" for m in p.marks)) for p in params]


def test_impl_dtype_params_are_the_declared_pairs():
    assert rows(impl_dtype_params([FUSED, TORCH_BF16])) == [
        ("fused-bfloat16", (FUSED, torch.bfloat16), False),
        ("fused-float16", (FUSED, torch.float16), False),
        ("torch-bf16-bfloat16", (TORCH_BF16, torch.bfloat16), False),
    ]


def test_impl_dtype_params_narrowed_to_undeclared_dtypes_give_no_row():
    assert impl_dtype_params([FUSED, TORCH_BF16], dtypes=(torch.float32,)) == []
    assert [p.id for p in impl_dtype_params([FUSED, NATIVE], dtypes=(torch.float32,))] == [
        "native-float32"]


def test_matrix_rows_per_declared_dtype_on_a_backend_that_runs():
    """The cpu backend always runs: one row per declared dtype, none for an undeclared one."""
    config = Options(["torch-bf16", "reference"], ["cpu"])
    got = rows(impl_backend_params(config, dtypes=()))
    assert [(i, v[1], s) for i, v, s in got] == [
        ("torch-bf16@cpu-bfloat16", torch.bfloat16, False),
        ("reference@cpu-bfloat16", torch.bfloat16, False),
        ("reference@cpu-float16", torch.float16, False),
        ("reference@cpu-float32", torch.float32, False),
    ]
    only_fp32 = rows(impl_backend_params(config, dtypes=(torch.float32,)))
    assert [i for i, _, _ in only_fp32] == ["reference@cpu-float32"]
    assert rows(impl_backend_params(config)) == [  # no dtypes asked: the plain pairs
        ("torch-bf16@cpu", (got[0][1][0],), False), ("reference@cpu", (got[1][1][0],), False)]


def test_a_pair_that_cannot_run_here_is_one_skipped_row():
    config = Options(["fused"], ["cuda"])
    got = rows(impl_backend_params(config, dtypes=()))
    if BACKENDS["cuda"].unavailable_reason():
        assert [(i, v[1], s) for i, v, s in got] == [("fused@cuda", None, True)]
    else:
        assert [(i, s) for i, _, s in got] == [("fused@cuda-bfloat16", False),
                                                ("fused@cuda-float16", False)]


def test_backends_narrow_the_matrix():
    config = Options(["reference"], [])
    ids = [p.id for p in impl_backend_params(config, backends=("cpu", "cuda"))]
    assert ids == ["reference@cpu", "reference@cuda"]


@pytest.mark.dtypes(torch.float16)
@pytest.mark.clause("suite-self-check")  # the plugin's own matrix, not the implementation
def test_the_dtypes_marker_narrows_the_matrix(impl_backend, impl_dtype, request):
    """Collected through the plugin itself: only float16 rows, of implementations declaring it."""
    assert impl_dtype == torch.float16 and impl_dtype in impl_backend.impl.dtypes
    assert request.node.callspec.id.endswith("-float16")
