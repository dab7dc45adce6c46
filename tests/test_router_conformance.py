"""Routers judged like kernels: every implementation's router (``impl.route``: its declared
``router``, else magi-moe's torch router) against the float64 router, on each router probe
(:mod:`audit.router_probes`: exact ties, a tie at the K-th place, NaN rows and NaN/inf biases,
a bias that flips choices, sums below the L1 floor) with sigmoid and softmax scores, by the
router judge (:func:`audit.router_judge.judge_router_call`: tie rule, NaN last, bias in the
choice only, L1 normalisation with eps, route_scale, head locality). Parametrized by
``impl_backend``, so ``magi-moe check`` / ``pytest --conformance`` run them for every
implementation, inside its declared shapes and dtypes.
"""
from __future__ import annotations

import pytest

from magi_moe.audit.router_judge import RouterVerdict, judge_router_call
from magi_moe.audit.router_probes import ROUTER_PROBES, router_probe
from magi_moe.config import MoEConfig, preset
from magi_moe.implementation import Implementation
from magi_moe.verdict import unsupported

ROUTER_CONFIGS = {
    "sigmoid": preset("tiny"),                                                  # L1 norm, scale 2.5
    "softmax": preset("tiny").replace(score_func="softmax", route_norm=False),  # no norm, scale 1
    "softmax-norm": preset("small").replace(score_func="softmax"),              # norm, scale 4.9
}
TOKENS = 24


def router_config(impl: Implementation, name: str) -> MoEConfig:
    """The named configuration moved inside ``impl``'s declared shapes, in its first dtype;
    ``pytest.skip`` with the reason when it still is not supported."""
    config = impl.shapes.nearest(ROUTER_CONFIGS[name].replace(dtype=impl.dtypes[0]))
    why = impl.supports(config)
    if why:
        pytest.skip(unsupported(f"unsupported: {why}"))
    return config


def judge_impl_router(impl: Implementation, device, probe: str, config_name: str, *,
                      seed: int = 0) -> RouterVerdict:
    config = router_config(impl, config_name)
    x, gate, bias = router_probe(probe, config, TOKENS, seed=seed, device=device)
    return judge_router_call(impl.route, x, gate, bias, config,
                             subject=f"{impl.name}.route on {probe}/{config_name}")


@pytest.mark.clause("routing")
@pytest.mark.parametrize("config_name", list(ROUTER_CONFIGS))
@pytest.mark.parametrize("probe", ROUTER_PROBES)
def test_router_follows_the_contract(impl_backend, probe, config_name):
    verdict = judge_impl_router(impl_backend.impl, impl_backend.device, probe, config_name)
    assert verdict.ok, verdict.text
