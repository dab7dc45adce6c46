"""The tuner's choices: the winning tiles over several cases' sweeps (:func:`best_tiles`,
:func:`best_routing`, by time normalised to each case's fastest candidate), the classes they
make (:func:`classes_of`) and how a partial sweep merges into a GPU's tabled classes
(:func:`merged_classes`)."""
from __future__ import annotations

import math

import torch

from magi_moe.kernels.tiles import FusedTiles, load_tile_table


# Share of (token, head) rows that must choose the same experts as the reference candidate.
ROUTING_AGREEMENT = 0.999


def same_choices(ids: torch.Tensor, want: torch.Tensor) -> float:
    """Share of (token, head) rows of ``[S, H, K]`` expert ids choosing the same set as
    ``want``. Compared per row, not by CSR position: one near-tie flip moves the CSR position
    of every later route of both banks involved, which failed every ``block_d`` but the
    reference's at S=16384 on the H200."""
    if ids.numel() == 0:
        return 1.0
    same = (ids.sort(dim=-1).values == want.sort(dim=-1).values).all(dim=-1)
    return float(same.double().mean())


def _key(tiles: dict) -> tuple:
    return tuple(sorted(tiles.items()))


def _normalised(sweeps: list[dict], kernel: str) -> dict[tuple, float]:
    """Per candidate: the sum over cases of its time over that case's fastest candidate;
    candidates that failed in any case are dropped."""
    scores: dict[tuple, float] = {}
    failed: set[tuple] = set()
    for sweep in sweeps:
        ok = [e["ms"] for e in sweep[kernel] if e["ms"] is not None]
        fastest = min(ok) if ok else 1.0
        for e in sweep[kernel]:
            key = _key(e["tiles"])
            if e["ms"] is None:
                failed.add(key)
            else:
                scores[key] = scores.get(key, 0.0) + e["ms"] / fastest
    return {k: v for k, v in scores.items() if k not in failed}


def _ms(sweep: dict, kernel: str, key: tuple) -> float:
    return next(e["ms"] for e in sweep[kernel] if _key(e["tiles"]) == key)


def best_tiles(sweeps: list[dict]):
    """The FusedTiles that minimise the time over the given cases' sweeps: per block_m the best
    gate/up and down candidates (by normalised time), then the block_m with the least total."""
    gu, dn, sm = (_normalised(sweeps, k) for k in ("gate_up", "down", "sum"))
    mlp = _normalised(sweeps, "mlp") if all("mlp" in s for s in sweeps) else {}
    best = None
    for bm in sorted({dict(k)["block_m"] for k in gu} & {dict(k)["block_m"] for k in dn}):
        g = min((v, k) for k, v in gu.items() if dict(k)["block_m"] == bm)[1]
        d = min((v, k) for k, v in dn.items() if dict(k)["block_m"] == bm)[1]
        total = sum(_ms(s, "gate_up", g) + _ms(s, "down", d) for s in sweeps)
        if best is None or total < best[0]:
            best = (total, g, d)
    for m in mlp:  # one kernel for both GEMMs: its time against the best pair's
        total = sum(_ms(s, "mlp", m) for s in sweeps)
        if best is None or total < best[0]:
            best = (total, m, ())
    if best is None:
        raise ValueError("no expert-kernel candidate ran in every case: nothing to choose")
    _, g, d = best
    st = min((v, k) for k, v in sm.items())[1]
    return FusedTiles(**{**dict(g), **dict(d), **dict(st)})


def best_routing(sweeps: list[dict]) -> dict:
    scores = _normalised(sweeps, "routing")
    return dict(min((v, k) for k, v in scores.items())[1])


def merged_classes(swept: list[tuple[float, object]], device_name: str, path=None):
    """The GPU's tabled classes with the swept ones put in: each swept group (routes per bank,
    tiles) replaces the tiles of the tabled class it falls in; edges and other classes stay.
    None when the GPU has no table yet."""
    tabled = load_tile_table(device_name, path)
    if not tabled:
        return None
    classes = list(tabled)
    for centre, tiles in swept:
        i = next(i for i, (edge, _) in enumerate(classes) if centre <= edge)
        classes[i] = (classes[i][0], tiles)
    return classes


def classes_of(per_case: list[tuple[float, dict]]) -> list[tuple[float | None, FusedTiles]]:
    """Cases with the same routes per bank (``per_case``: routes per bank, sweep) share tiles:
    one class per such group, its upper edge at the geometric midpoint to the next (None: the
    last, no limit)."""
    groups: dict[float, list[dict]] = {}
    for routes_per_bank, sweep in per_case:
        groups.setdefault(round(routes_per_bank, 3), []).append(sweep)
    centres = sorted(groups)
    return [(math.sqrt(c * centres[i + 1]) if i + 1 < len(centres) else None, best_tiles(groups[c]))
            for i, c in enumerate(centres)]
