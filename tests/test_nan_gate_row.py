"""A NaN row written straight into ``layer.gate`` (past ``load_state_dict``'s finiteness check)
under softmax routing: CONTRACT section 1 promises that only that expert is affected. It ranks
last and is never chosen while K other experts remain, the head's other experts keep the scores
of a softmax over themselves, and no token's output turns NaN. Under sigmoid the same holds
without any masking (each expert is scored alone), so the rule is one rule for both."""
from __future__ import annotations

import pytest
import torch

from magi_moe.config import preset
from magi_moe.layer import MagiMoE
from magi_moe.routing import route

NAN_BANK = 5  # head 0, expert 5


def _problem(score_func: str):
    cfg = preset("small-softmax").replace(score_func=score_func)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, cfg.hidden_size, generator=gen).bfloat16()
    gate = torch.randn(cfg.num_banks, cfg.head_dim, generator=gen) / 4
    return cfg, x, gate


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_nan_gate_row_routes_as_if_the_expert_were_absent(score_func):
    cfg, x, gate = _problem(score_func)
    bad = gate.clone()
    bad[NAN_BANK] = float("nan")
    got = route(x, bad, None, cfg, dtype=torch.float64)
    H, E, K = cfg.num_heads, cfg.num_experts, cfg.top_k
    # the same routing computed by hand without expert 5 of head 0
    logits = torch.einsum("shd,hed->she", x.double().reshape(-1, H, cfg.head_dim),
                          gate.double().reshape(H, E, cfg.head_dim))
    keep = [e for e in range(E) if e != NAN_BANK]
    head0 = logits[:, 0, keep]
    scores0 = head0.softmax(-1) if score_func == "softmax" else head0.sigmoid()
    top = torch.sort(scores0, dim=-1, descending=True, stable=True)
    want_ids = torch.tensor(keep)[top.indices[:, :K]]
    assert torch.equal(got.expert_ids[:, 0], want_ids)
    want_p = top.values[:, :K]
    if cfg.route_norm:
        want_p = want_p / want_p.sum(-1, keepdim=True)
    torch.testing.assert_close(got.probs[:, 0], want_p * cfg.route_scale, rtol=1e-12, atol=0)
    # head 1 is untouched
    clean = route(x, gate, None, cfg, dtype=torch.float64)
    assert torch.equal(got.expert_ids[:, 1:], clean.expert_ids[:, 1:])
    assert torch.equal(got.probs[:, 1:], clean.probs[:, 1:])


@pytest.mark.parametrize("write", ["no_grad", "data"])
def test_nan_gate_row_written_into_the_layer_spares_every_token(write):
    cfg, x, _ = _problem("softmax")
    layer = MagiMoE(cfg, bias_source="none", impl="torch-bf16")
    before = layer(x)
    if write == "no_grad":
        with torch.no_grad():
            layer.gate[NAN_BANK] = float("nan")
    else:  # bypasses the version counter: no check could see it without a host sync per call
        layer.gate.data[NAN_BANK] = float("nan")
    after = layer(x)
    assert not torch.isnan(after).any(), "a NaN gate row poisoned tokens"
    Dh = cfg.head_dim
    assert torch.equal(after[:, Dh:], before[:, Dh:]), "head 1 changed"
    routes = route(x, layer.gate, None, cfg)
    assert not (routes.expert_ids[:, 0] == NAN_BANK).any()
