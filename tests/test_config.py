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


# -- docs/PLUGGING_IN.md's MoEConfig table, generated-checked against the dataclass -------------

def _documented_fields() -> list[list[str]]:
    """The rows of the table between the moeconfig-fields markers, as cells."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "PLUGGING_IN.md").read_text()
    body = text.split("<!-- moeconfig-fields -->", 1)[1].split("<!-- /moeconfig-fields -->", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in body.strip().splitlines()[2:]]
    return [[cell.strip().strip("`") for cell in row] for row in rows]


def _documented_default(field) -> str:
    import dataclasses

    if field.default is dataclasses.MISSING:
        return "required"
    value = field.default
    return f'"{value}"' if isinstance(value, str) else str(value)


def test_the_plugging_in_table_lists_every_moeconfig_field_with_its_type_and_default():
    import dataclasses

    fields = dataclasses.fields(MoEConfig)
    rows = _documented_fields()
    assert [r[0] for r in rows] == [f.name for f in fields], "the table's fields, in order"
    for row, field in zip(rows, fields):
        annotation = field.type if isinstance(field.type, str) else field.type.__name__
        expected_type = {"ScoreFunc": "str"}.get(annotation, annotation)
        assert row[1] == expected_type, (field.name, row[1], annotation)
        assert row[2] == _documented_default(field), (field.name, row[2])
        assert row[3], f"{field.name} has no meaning in the table"


def test_the_table_check_catches_a_field_the_docs_lack(monkeypatch):
    """Planted drift: a field added to the dataclass and not to the table fails the check."""
    import dataclasses

    grown = dataclasses.make_dataclass("Grown", [("new_field", int, dataclasses.field(default=0))],
                                       bases=(MoEConfig,), frozen=True)
    monkeypatch.setitem(globals(), "MoEConfig", grown)
    with pytest.raises(AssertionError, match="the table's fields"):
        test_the_plugging_in_table_lists_every_moeconfig_field_with_its_type_and_default()


def test_preset_refuses_a_name_that_is_not_a_string():
    with pytest.raises(TypeError, match=r"preset name must be a str, one of \[.*\], got list \['tiny'\]"):
        preset(["tiny"])
