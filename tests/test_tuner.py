"""The tile tuner's bookkeeping (``tuner/``, a checkout's; no GPU needed): which candidate wins,
how a partial sweep is merged into the tabled classes without disturbing the others, and its
command line's checks."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")
pytest.importorskip("tuner", reason="the tuner is in a checkout (python -m tuner), not the wheel")

import math

from magi_moe.kernels.tiles import FusedTiles, load_tile_table, write_tile_table
from tuner.choose import best_tiles, classes_of, merged_classes


def _sweep(gate_up: dict, down: dict, mlp: dict | None = None) -> dict:
    """A sweep result: gate_up/down/mlp map a candidate's tiles (as tuples) to ms or None."""
    return {"gate_up": [{"tiles": dict(t), "ms": ms} for t, ms in gate_up.items()],
            "down": [{"tiles": dict(t), "ms": ms} for t, ms in down.items()],
            "mlp": [{"tiles": dict(t), "ms": ms} for t, ms in (mlp or {}).items()],
            "sum": [{"tiles": {"sum_block_t": 8, "sum_warps": 4}, "ms": 0.01}]}


FAST = (("block_m", 64), ("gu_variant", "kloop"), ("gu_block_k", 32))
SLOW = (("block_m", 64), ("gu_variant", "kloop"), ("gu_block_k", 16))
BROKEN = (("block_m", 64), ("gu_variant", "kloop"), ("gu_block_k", 64))
DOWN = (("block_m", 64), ("down_block_k", 32))


def test_best_tiles_takes_the_fastest_and_drops_candidates_that_failed_anywhere():
    one = _sweep({FAST: 1.0, SLOW: 1.2, BROKEN: 0.5}, {DOWN: 0.4})
    two = _sweep({FAST: 2.0, SLOW: 2.1, BROKEN: None}, {DOWN: 0.8})
    tiles = best_tiles([one, two])
    assert (tiles.gu_variant, tiles.gu_block_k, tiles.down_block_k) == ("kloop", 32, 32)


def test_cases_with_the_same_routes_per_bank_make_one_class():
    """Classes end at the geometric midpoint between neighbouring groups; the last has no limit."""
    fast, slow = _sweep({FAST: 1.0, SLOW: 1.2}, {DOWN: 0.4}), _sweep({FAST: 1.3, SLOW: 1.2}, {DOWN: 0.4})
    classes = classes_of([(4.0, fast), (16.0, slow), (4.0001, fast)])
    assert [edge for edge, _ in classes] == [8.0, None]
    assert [t.gu_block_k for _, t in classes] == [32, 16]


MLP = (("block_m", 64), ("gu_variant", "mlp_tma"), ("gu_block_n", 32))


def test_one_kernel_candidate_wins_only_against_the_best_pair_total():
    """The gate/up + down kernel is timed whole: it must beat the best pair's sum (1.4 here)."""
    slower = _sweep({FAST: 1.0, SLOW: 1.2}, {DOWN: 0.4}, {MLP: 1.45})
    assert best_tiles([slower]).gu_variant == "kloop"
    faster = _sweep({FAST: 1.0, SLOW: 1.2}, {DOWN: 0.4}, {MLP: 1.3})
    tiles = best_tiles([faster])
    assert (tiles.gu_variant, tiles.gu_block_n) == ("mlp_tma", 32)
    failed = _sweep({FAST: 1.0}, {DOWN: 0.4}, {MLP: None})
    assert best_tiles([failed]).gu_variant == "kloop"


def test_merge_replaces_only_the_class_the_swept_case_falls_in(tmp_path):
    path = tmp_path / "fused.json"
    old = [(10.0, FusedTiles(gu_block_n=32)), (100.0, FusedTiles(gu_block_n=64)),
           (None, FusedTiles(gu_block_n=128))]
    write_tile_table("TestGPU", old, routing={"block_s": 16}, path=path)
    new = FusedTiles(gu_block_n=128, gu_variant="mlp_tma")
    merged = merged_classes([(384.0, new)], "Test GPU TestGPU 141GB", path=path)
    assert [edge for edge, _ in merged] == [10.0, 100.0, math.inf]
    assert [t.gu_block_n for _, t in merged[:2]] == [32, 64]
    assert merged[2][1] == new
    assert load_tile_table("TestGPU", path)[2][1].gu_variant == "kloop"  # nothing written yet
    assert merged_classes([(5.0, new)], "another GPU", path=path) is None


WIDE = (("block_m", 128), ("gu_variant", "mlp_tma"), ("gu_block_n", 32))


def test_a_one_kernel_only_sweep_chooses_among_its_candidates():
    """``--kernels mlp``: no gate/up or down timed, so the one-kernel candidates compete
    alone; with none left, a clear error."""
    sweeps = [_sweep({}, {}, {MLP: 1.0, WIDE: 0.9}), _sweep({}, {}, {MLP: 2.0, WIDE: 1.9})]
    tiles = best_tiles(sweeps)
    assert (tiles.block_m, tiles.gu_block_n, tiles.gu_variant) == (128, 32, "mlp_tma")
    with pytest.raises(ValueError, match="no expert-kernel candidate"):
        best_tiles([_sweep({}, {}, {MLP: None})])


@pytest.mark.parametrize("kernels, message", [("mlp,bogus", "must be among"),
                                              ("down", "add gate_up")])
def test_swept_kernels_are_checked(kernels, message, capsys):
    from tuner.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--kernels", kernels])
    assert message in capsys.readouterr().err


def test_the_tuner_refuses_a_machine_without_a_gpu(capsys):
    import torch

    from tuner.__main__ import parse_args

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        parse_args(["--kernels", "mlp"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_routing_candidates_are_compared_by_the_experts_each_row_chose():
    """A near-tie flipped in one of 10,000 rows keeps a routing candidate (the CSR positions
    of later routes would all have moved); a flip in one row of 100 does not; the order of the
    picks within a row does not matter."""
    import torch

    from tuner.choose import ROUTING_AGREEMENT, same_choices

    gen = torch.Generator().manual_seed(5)
    want = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(10_000)]).view(
        5_000, 2, 4).to(torch.int32)
    got = want.flip(-1).clone()
    assert same_choices(got, want) == 1.0
    got[17, 1, 0] = (set(range(16)) - set(want[17, 1].tolist())).pop()
    assert same_choices(got, want) == 1 - 1 / 10_000 >= ROUTING_AGREEMENT
    assert same_choices(got[:50], want[:50]) == 0.99 < ROUTING_AGREEMENT
    assert same_choices(got[:0], want[:0]) == 1.0
