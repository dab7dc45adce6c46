"""What the H200 fuzz campaigns found, replayed from their records on every commit.

Each entry is the campaign's own reproduction record (``python -m fuzz replay``) with the
backend swapped for the one under test; each failed before its fix on the CPU interpreter too:

* ``subnormal-route``: a routing weight that underflowed to an fp32 subnormal (5e-39). On the
  GPU the atomic native kernel's fp32 atomics flushed the route's contribution (now modelled:
  ``bf16-fp32acc-atomic``); under the interpreter the fused kernel's bf16 rounding of the
  subnormal result was wrong (the interpreter's own cast; now done on the bit pattern).
* ``fp16-linearity-boundary``: an fp16 output just below the smallest normal rounds up to it,
  so doubling the routing weights legitimately lands one subnormal step from twice the output.
* ``wide-head``: Dh = 272 (the native kernel asked the H200 for 256 KiB of shared memory).
"""
from __future__ import annotations

import copy

import pytest

from magi_moe.fuzz.fuzzers import replay

SUBNORMAL_ROUTE = {
    "case": {"config": {"dtype": "bfloat16", "head_dim": 64, "intermediate_size": 16,
                        "num_experts": 1, "num_heads": 1, "route_norm": False, "route_scale": 1.0,
                        "score_func": "sigmoid", "top_k": 1},
             "empty_banks": [], "num_tokens": 17,
             "routing": {"bias_std": 0.05, "gate_std": 2.0, "head": 0, "hot": 1, "kind": "router",
                         "levels": 1, "seed": 0},
             "type": "ExpertCase",
             "values": {"outliers": [], "preact": 1.0, "seed": 0, "wide_span": 1,
                        "x_dist": "narrow", "x_scale": 1.0}},
    "params": {}, "property": "differential"}
FP16_LINEARITY = {
    "case": {"config": {"dtype": "float16", "head_dim": 16, "intermediate_size": 16,
                        "num_experts": 2, "num_heads": 1, "route_norm": False, "route_scale": 1.0,
                        "score_func": "sigmoid", "top_k": 1},
             "empty_banks": [], "num_tokens": 4095,
             "routing": {"bias_std": 0.05, "gate_std": 0.25, "head": 0, "hot": 1, "kind": "router",
                         "levels": 1, "seed": 0},
             "type": "ExpertCase",
             "values": {"outliers": [], "preact": 1.0, "seed": 0, "wide_span": 1,
                        "x_dist": "normal", "x_scale": 0.0009765625}},
    "params": {}, "property": "linearity"}
WIDE_HEAD = copy.deepcopy(SUBNORMAL_ROUTE)
WIDE_HEAD["case"]["config"].update(head_dim=272, intermediate_size=48)
WIDE_HEAD["case"]["num_tokens"] = 1
WIDE_HEAD["case"]["routing"]["gate_std"] = 0.25
WIDE_HEAD["case"]["values"]["x_dist"] = "normal"

FINDINGS = {
    "subnormal-route": (SUBNORMAL_ROUTE, ("native", "native-det", "fused")),
    "fp16-linearity-boundary": (FP16_LINEARITY, ("fused",)),
    "wide-head": (WIDE_HEAD, ("native", "native-det")),
}


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
@pytest.mark.parametrize("finding,impl", [(f, i) for f, (_, impls) in FINDINGS.items()
                                          for i in impls])
def test_campaign_finding_stays_fixed(finding, impl, triton_device):
    record = {**copy.deepcopy(FINDINGS[finding][0]), "impl": impl,
              "backend": "cuda" if triton_device.type == "cuda" else "interpret"}
    replay(record)  # raises PropertyViolation on failure
