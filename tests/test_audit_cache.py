"""The weight-cache auditor proven on toys: a cache keyed on (id, data_ptr, _version) is caught
serving stale weights after ``param.data.copy_`` and crashing on inference tensors; a cache that
repacks every call is caught; a content-checking cache passes every route. Then the real fused
layer, where it runs, built as every layer is: ``impl.layer(config, state_dict, device)``.
Outside layers (their own modules and caches) are in tests/test_outside_layers.py."""
from __future__ import annotations

import pytest

from magi_moe.audit.cache import (DETECTED, NEEDS_INVALIDATE, NOT_MEASURED, ROUTES, SKIPPED, UNSUPPORTED,
                         audit_weight_cache)
from magi_moe.backends import get_backend
from magi_moe.config import preset
from magi_moe.registry import get_implementation
from magi_moe.tests.audit_broken import correct_cache_layer, repacking_cache_layer, stale_cache_layer

TINY = preset("tiny")


pytestmark = pytest.mark.usefixtures("single_thread")  # see conftest


def test_stale_identity_key_is_caught():
    report = audit_weight_cache(stale_cache_layer, config=TINY, label="stale")
    assert report.has_cache and not report.ok
    by_route = report.by_route()
    assert by_route["param_data_copy"] == NEEDS_INVALIDATE   # CONTRACT 5: key unchanged
    assert by_route["inference_mode"] == UNSUPPORTED         # _version raises
    for route in ("in_place", "copy_no_grad", "load_state_dict", "load_assign",
                  "param_data_assign", "new_storage", "to_dtype"):
        assert by_route[route] == DETECTED, (route, report.summary())
    stale = [r for r in report.results if r.route == "param_data_copy"]
    assert all(not r.ok and "stale" in r.detail for r in stale)
    measured = [r for r in report.results if r.status not in (SKIPPED, UNSUPPORTED)]
    assert measured and all(r.repacks_without_change == 0 for r in measured)


def test_promised_invalidation_is_accepted():
    def layer(config, state_dict, device):
        model = stale_cache_layer(config, state_dict, device)
        model.weight_cache.promises = {"param_data_copy": NEEDS_INVALIDATE}
        return model

    report = audit_weight_cache(layer, config=TINY, routes=("param_data_copy",), parameters=("W_up",))
    assert report.ok, report.summary()
    assert report.results[0].status == NEEDS_INVALIDATE


def test_content_key_passes_every_route():
    seen = []
    report = audit_weight_cache(correct_cache_layer, config=TINY, label="contents",
                                on_result=seen.append)
    assert report.ok, report.summary()
    assert seen == report.results
    assert {r.route for r in report.results} == set(ROUTES)
    assert report.by_route()["to_device"] == SKIPPED  # CUDA only
    assert all(r.repacks_after_change == 1 for r in report.results if r.status == DETECTED)


def test_repack_on_every_call_is_caught():
    report = audit_weight_cache(repacking_cache_layer, config=TINY, routes=("in_place",),
                                parameters=("W_gate",))
    assert not report.ok
    assert report.results[0].status == DETECTED and report.results[0].repacks_without_change > 0


def test_layer_without_cache_is_audited_too():
    """No cache protocol: every route still runs (a hidden cache would be caught), pack counts
    are not measured."""
    report = audit_weight_cache("reference", config=TINY)
    assert not report.has_cache and not report.measures_packs and report.ok, report.summary()
    assert "no cache protocol" in report.summary() and NOT_MEASURED in report.summary()
    assert {r.route for r in report.results} == set(ROUTES)
    ran = [r for r in report.results if r.status != SKIPPED]
    assert ran and all(r.status == DETECTED and r.repacks_after_change is None for r in ran)


@pytest.mark.parametrize("subject, kwargs, exc, pattern", [
    pytest.param(correct_cache_layer, dict(config=TINY, routes=("reload",)), ValueError,
                 "routes must be among", id="unknown-route"),
    pytest.param(correct_cache_layer, dict(config=TINY, parameters=("gate",)), ValueError,
                 "parameters must be", id="router-parameter"),
    pytest.param(correct_cache_layer, dict(config="tiny"), TypeError, "config must be a MoEConfig",
                 id="config-name"),
    pytest.param(42, dict(config=TINY), TypeError, "impl_or_factory must be", id="subject-int"),
])
def test_bad_arguments(subject, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        audit_weight_cache(subject, **kwargs)


def _fused_or_skip(backend: str):
    why = get_backend(backend).unavailable_reason()
    if why:
        pytest.skip(f"backend {backend} unavailable: {why}")
    try:
        return get_implementation("fused")
    except ValueError:
        pytest.skip("no 'fused' implementation registered")


@pytest.mark.interpret
def test_fused_layer_under_interpreter():
    """The routes a key-based cache gets wrong, on the real fused layer (a subset: interpreted
    kernels are slow; python -m audit runs them all)."""
    fused = _fused_or_skip("interpret")
    report = audit_weight_cache(fused, config=TINY, routes=("param_data_copy", "param_data_assign"),
                                parameters=("W_up",))
    assert report.ok, report.summary()


@pytest.mark.interpret
def test_fused_layer_built_under_inference_mode():
    """Regression: from_state_dict inside torch.inference_mode packed the meta skeleton at
    construction and set_data refused; the cache now waits for values."""
    fused = _fused_or_skip("interpret")
    report = audit_weight_cache(fused, config=TINY, routes=("inference_mode",), parameters=("W_up",))
    assert report.ok, report.summary()


@pytest.mark.cuda
def test_fused_layer_on_gpu(cuda_device):
    fused = _fused_or_skip("cuda")
    report = audit_weight_cache(fused, config=preset("small"), device=cuda_device)
    assert report.ok, report.summary()
    assert report.by_route()["to_device"] == DETECTED
