"""The fused path's tile records refuse what the kernels cannot run, and the table lookup says
which file and entry it used and warns, once, when it falls back or is overridden (no GPU
needed: the lookup by GPU name reads a table written here)."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from magi_moe.config import MoEConfig, preset
from magi_moe.kernels import tiles as T
from magi_moe.kernels.tiles import (FusedTiles, RoutingTiles, TileTableWarning, fused_tile_choice,
                                    gpu_routing_tiles, gpu_tile_choice, load_tile_table,
                                    write_tile_table)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(T, "_warned", set())


@pytest.mark.parametrize("record,field,value,expected", [
    (FusedTiles, "block_m", 48, "a positive power of two"),
    (FusedTiles, "gu_block_k", 0, "a positive power of two"),
    (FusedTiles, "gu_warps", 3, "a positive power of two"),
    (FusedTiles, "sum_block_t", 16.0, "a positive power of two"),
    (FusedTiles, "gu_stages", 0, "a positive int"),
    (FusedTiles, "down_programs_per_sm", True, "a positive int"),
    (FusedTiles, "gu_maxnreg", -1, "an int >= 0"),
    (FusedTiles, "gu_variant", "tma", "one of ('kloop', 'mlp_tma')"),
    (RoutingTiles, "block_s", 24, "a positive power of two"),
    (RoutingTiles, "place_warps", 0, "a positive power of two"),
], ids=lambda v: str(v) if not isinstance(v, type) else v.__name__)
def test_bad_tiles_are_refused_naming_the_field(record, field, value, expected):
    with pytest.raises(ValueError) as raised:
        record(**{field: value})
    assert str(raised.value) == f"{record.__name__}.{field} must be {expected}, got {value!r}"


def test_fitted_tiles_stay_valid_and_divide_the_widths():
    cfg = MoEConfig(num_heads=2, head_dim=48, num_experts=4, top_k=2, intermediate_size=80)
    tiles = T.PORTABLE_TILES.fitted(cfg)
    assert (tiles.gu_block_n, tiles.gu_block_k, tiles.down_block_n, tiles.down_block_k) == (16, 16, 16, 16)
    assert RoutingTiles(block_d=256).fitted(cfg).block_d == 16
    one_kernel = FusedTiles(gu_variant="mlp_tma", block_m=128, gu_block_n=32, gu_block_k=256)
    fallback = T.two_kernel_tiles(one_kernel, cfg)
    assert fallback.gu_variant == "kloop" and fallback.block_m == 128 and fallback.gu_warps == 8


def test_the_shipped_table_names_exactly_the_fields_of_its_records():
    """The shipped tables are written as :func:`write_tile_table` writes them now: every class
    names each :class:`FusedTiles` field and no other (a field dropped from the record is
    dropped from the table too, not silently ignored by the loader)."""
    from dataclasses import fields

    table = json.loads(T.TILE_TABLE.read_text())
    want = {f.name for f in fields(FusedTiles)}
    for entry in table["devices"]:
        for i, cls in enumerate(entry["classes"]):
            assert set(cls["tiles"]) == want, (entry["match"], i, set(cls["tiles"]) ^ want)
        if "routing" in entry:
            assert set(entry["routing"]) <= {f.name for f in fields(RoutingTiles)}, entry["match"]


def _table(tmp_path):
    path = tmp_path / "fused.json"
    write_tile_table("TestGPU", [(10.0, FusedTiles(gu_block_n=32)), (None, FusedTiles(gu_block_n=128))],
                     routing={"block_s": 16, "warps": 4}, note="written by a test", path=path)
    return path


def test_a_tabled_gpu_gets_its_class_and_says_where_from(tmp_path):
    path = _table(tmp_path)
    cfg = preset("tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tabled GPU warns of nothing
        light = gpu_tile_choice(cfg, 5 * cfg.num_banks, "NVIDIA TestGPU 80GB", path)
        heavy = gpu_tile_choice(cfg, 50 * cfg.num_banks, "nvidia testgpu", path)
        routing = gpu_routing_tiles("NVIDIA TestGPU", path)
    assert (light.source, light.entry, light.edge) == ("table", "TestGPU", 10.0)
    assert light.tiles == FusedTiles(gu_block_n=32).fitted(cfg)
    assert (heavy.edge, heavy.tiles) == (math.inf, FusedTiles(gu_block_n=128).fitted(cfg))
    assert str(light) == f"{path}, entry 'TestGPU', class up to 10 routes per bank"
    assert str(heavy) == f"{path}, entry 'TestGPU', class no limit routes per bank"
    assert (routing.block_s, routing.warps, routing.block_d) == (16, 4, RoutingTiles().block_d)


def test_a_rewritten_table_is_read_by_the_next_choice(tmp_path):
    """Choices are cached per (config, class, GPU, table); writing the table (a sweep) must
    drop them, or a benchmark run after the sweep in one process times the old tiles."""
    path = _table(tmp_path)
    cfg = preset("tiny")
    before = gpu_tile_choice(cfg, 5 * cfg.num_banks, "NVIDIA TestGPU", path)
    write_tile_table("TestGPU", [(10.0, FusedTiles(gu_block_n=16)), (None, FusedTiles())],
                     note="rewritten", path=path)
    after = gpu_tile_choice(cfg, 5 * cfg.num_banks, "NVIDIA TestGPU", path)
    assert before.tiles.gu_block_n == 32 and after.tiles.gu_block_n == 16


def test_an_untabled_gpu_falls_back_to_portable_tiles_with_one_warning(tmp_path):
    path = _table(tmp_path)
    cfg = preset("tiny")
    with pytest.warns(TileTableWarning, match="OtherGPU use PORTABLE_TILES .*no entry for this GPU"):
        choice = gpu_tile_choice(cfg, 100, "OtherGPU", path)
    assert choice.source == "portable" and choice.tiles == T.PORTABLE_TILES.fitted(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per GPU and table
        assert gpu_tile_choice(cfg, 7, "OtherGPU", path).source == "portable"
    with pytest.warns(TileTableWarning, match="no such file"):
        gpu_tile_choice(cfg, 100, "OtherGPU", tmp_path / "missing.json")
    with pytest.warns(TileTableWarning, match="default RoutingTiles"):
        assert gpu_routing_tiles("OtherGPU", path) == RoutingTiles()


def test_a_bad_table_value_names_the_file_entry_and_field(tmp_path):
    path = tmp_path / "fused.json"
    path.write_text(json.dumps({"devices": [{"match": "TestGPU", "classes": [
        {"max_routes_per_bank": None, "tiles": {"block_m": 96, "retired_field": 1}}]}]}))
    with pytest.raises(ValueError, match=r"fused.json, entry 'TestGPU', classes\[0\].tiles: "
                                         r"FusedTiles.block_m must be a positive power of two, got 96"):
        load_tile_table("TestGPU", path)


def test_the_interpreter_uses_its_own_tiles_without_a_warning(monkeypatch):
    monkeypatch.delenv(T.OVERRIDE_ENV, raising=False)
    cfg = preset("tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = fused_tile_choice(cfg, 100, torch.device("cpu"))
    assert choice.source == "interpreter" and choice.tiles == T.INTERPRETER_TILES.fitted(cfg)
    assert str(choice) == "INTERPRETER_TILES"


def test_the_environment_override_wins_and_warns_once(monkeypatch):
    cfg = preset("tiny")
    monkeypatch.setenv(T.OVERRIDE_ENV, '{"block_m": 32, "gu_variant": "mlp_tma"}')
    with pytest.warns(TileTableWarning, match="MAGI_MOE_FUSED_TILES is set"):
        choice = fused_tile_choice(cfg, 100, torch.device("cpu"))
    assert choice.source == "environment"
    assert (choice.tiles.block_m, choice.tiles.gu_variant, choice.tiles.gu_warps) == (32, "mlp_tma", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused_tile_choice(cfg, 100, torch.device("cpu")) == choice


@pytest.mark.parametrize("value,message", [
    ("{block_m: 32}", "must be a JSON object of FusedTiles fields"),
    ('{"block_n": 32}', r"unknown: \['block_n'\]"),
    ("[32]", "must be a JSON object of FusedTiles fields"),
    ('{"block_m": 33}', "MAGI_MOE_FUSED_TILES: FusedTiles.block_m must be a positive power of two"),
])
def test_a_bad_override_is_refused_naming_the_variable(monkeypatch, value, message):
    monkeypatch.setenv(T.OVERRIDE_ENV, value)
    with pytest.raises(ValueError, match=message):
        fused_tile_choice(preset("tiny"), 100, torch.device("cpu"))
