"""The configuration object: presets are valid, and every invalid field is named in its error."""
import pytest
import torch

from magi_moe.config import PRESETS, MoEConfig, preset


def test_released_presets_match_the_spec():
    full, local = preset("magi2-full"), preset("magi2-ep4-local")
    assert (full.num_heads, full.hidden_size) == (12, 3072)
    assert (local.num_heads, local.hidden_size) == (3, 768)
    for cfg in (full, local):
        assert (cfg.head_dim, cfg.num_experts, cfg.top_k, cfg.intermediate_size) == (256, 256, 6, 1280)
        assert (cfg.score_func, cfg.route_norm, cfg.route_scale, cfg.dtype) == (
            "sigmoid", True, 4.9, torch.bfloat16)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid(name):
    cfg = PRESETS[name]
    assert cfg.num_banks == cfg.num_heads * cfg.num_experts
    assert MoEConfig(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}) == cfg


BASE = dict(num_heads=2, head_dim=32, num_experts=8, top_k=2, intermediate_size=64)

INVALID = [
    (dict(num_heads=0), "num_heads"),
    (dict(head_dim=-16), "head_dim"),
    (dict(head_dim=40), "head_dim must be a multiple of 16"),
    (dict(intermediate_size=72), "intermediate_size must be a multiple of 16"),
    (dict(num_experts=2.0), "num_experts"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=9), r"top_k must lie in \[1, num_experts=8\]"),
    (dict(score_func="relu"), "score_func"),
    (dict(route_norm=1), "route_norm"),
    (dict(route_scale=0.0), "route_scale"),
    (dict(route_scale=float("inf")), "route_scale"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(num_heads=True), "num_heads"),
]


@pytest.mark.parametrize("change,message", INVALID, ids=[m.split()[0] for _, m in INVALID])
def test_invalid_field_raises_value_error_naming_it(change, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**BASE, **change})


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="magi2-full"):
        preset("magi3")
