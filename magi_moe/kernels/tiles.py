"""Tile shapes of the fused path's kernels, and the per-GPU tables they are chosen from.

* :class:`FusedTiles` (the expert GEMMs and the top-k sum) and :class:`RoutingTiles` (the fused
  router), each checked when built: a block a kernel indexes with ``tl.arange`` must be a power
  of two, a variant must be one the planner knows.
* The fixed sets: :data:`INTERPRETER_TILES` (the CPU interpreter) and :data:`PORTABLE_TILES`
  (any CUDA GPU without a table entry).
* The tables in ``tiles/fused.json`` (``tiles/README.md`` describes the format): read by
  :func:`load_device_entry` / :func:`load_tile_table`, written by :func:`write_tile_table`
  (by the checkout's tuner, ``python -m tuner``). :func:`fused_tile_choice` says which
  file and which entry it used (:class:`TileChoice`); a GPU without an entry, a missing file and
  the ``MAGI_MOE_FUSED_TILES`` override each warn once (:class:`TileTableWarning`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

import torch

from ..config import MoEConfig

TILE_TABLE_DIR = Path(__file__).with_name("tiles")
TILE_TABLE = TILE_TABLE_DIR / "fused.json"
TABLE_FORMAT = ("devices[].match is a substring of torch.cuda.get_device_name(); classes[] apply "
                "up to max_routes_per_bank = R / (H*E) (null: no limit)")
OVERRIDE_ENV = "MAGI_MOE_FUSED_TILES"

# "kloop": gate/up and down as two kernels, a K loop per column tile (kernels/gate_up_down.py);
# "mlp_tma": gate/up and the down projection of a whole row block in one work item
# (kernels/expert_mlp.py).
GATE_UP_VARIANTS = ("kloop", "mlp_tma")

log = logging.getLogger(__name__)


class TileTableWarning(UserWarning):
    """The fused kernels run on tiles that no table entry for this GPU chose."""


def _check_int(owner: str, name: str, value, *, power_of_two: bool = False,
               minimum: int = 1) -> None:
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (power_of_two and value & (value - 1))):
        want = "a positive power of two" if power_of_two else (
            "a positive int" if minimum == 1 else f"an int >= {minimum}")
        raise ValueError(f"{owner}.{name} must be {want}, got {value!r}")


def _check_choice(owner: str, name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# the expert kernels' tiles
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedTiles:
    """Block shapes of the expert kernels and the top-k sum. ``block_m`` is shared: it sets the
    padding."""

    block_m: int = 64
    gu_block_n: int = 64
    gu_block_k: int = 64
    gu_warps: int = 4
    gu_stages: int = 3
    # One of GATE_UP_VARIANTS. "mlp_tma" loads x rows once and streams [Dh, gu_block_n] weight
    # tiles with no activation buffer (the down_* fields are then unused; gu_block_k is the
    # whole Dh). Where a variant cannot run the launch plan (kernels/plan.py) says why and
    # which kernels run instead.
    gu_variant: str = "kloop"
    gu_maxnreg: int = 0         # register cap per thread (0: the compiler's choice), for occupancy
    down_block_n: int = 128
    down_block_k: int = 64
    down_warps: int = 4
    down_stages: int = 3
    sum_block_t: int = 16
    sum_warps: int = 4
    # Persistent grids: programs per multiprocessor (the occupancy the tiles allow).
    gu_programs_per_sm: int = 1
    down_programs_per_sm: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "gu_block_n", "gu_block_k", "down_block_n", "down_block_k",
                     "sum_block_t", "gu_warps", "down_warps", "sum_warps"):
            _check_int("FusedTiles", name, getattr(self, name), power_of_two=True)
        for name in ("gu_stages", "down_stages", "gu_programs_per_sm", "down_programs_per_sm"):
            _check_int("FusedTiles", name, getattr(self, name))
        _check_int("FusedTiles", "gu_maxnreg", self.gu_maxnreg, minimum=0)
        _check_choice("FusedTiles", "gu_variant", self.gu_variant, GATE_UP_VARIANTS)

    def fitted(self, config: MoEConfig) -> "FusedTiles":
        """The same tiles with N/K blocks shrunk to powers of two dividing the widths (the
        config guarantees multiples of 16), so the kernels' inner loops need no masks."""
        return _fitted_fused(self, config)


@lru_cache(maxsize=1024)
def _fitted_fused(tiles: FusedTiles, config: MoEConfig) -> FusedTiles:
    Dh, I = config.head_dim, config.intermediate_size
    return replace(tiles, gu_block_n=_divisor_block(I, tiles.gu_block_n),
                   gu_block_k=_divisor_block(Dh, tiles.gu_block_k),
                   down_block_n=_divisor_block(Dh, tiles.down_block_n),
                   down_block_k=_divisor_block(I, tiles.down_block_k))


def _divisor_block(width: int, want: int) -> int:
    """The largest power of two <= ``want`` that divides ``width``."""
    block = min(want, 1 << (width.bit_length() - 1))
    while width % block:
        block //= 2
    return max(block, 1)


# The interpreter pays per program and per operation, not per element: small row blocks (little
# padding), whole widths per program (few programs, few loop trips), one warp.
INTERPRETER_TILES = FusedTiles(block_m=16, gu_block_n=256, gu_block_k=256, gu_warps=1,
                               gu_stages=1, down_block_n=256, down_block_k=256, down_warps=1,
                               down_stages=1, sum_block_t=64, sum_warps=1)
# Any CUDA GPU without a table entry (Ampere and later run these).
PORTABLE_TILES = FusedTiles(block_m=64, gu_block_n=64, gu_block_k=64, gu_warps=4, gu_stages=2,
                            down_block_n=128, down_block_k=32, down_warps=4, down_stages=2)


@lru_cache(maxsize=1024)  # the planner asks on every call
def two_kernel_tiles(tiles: FusedTiles, config: MoEConfig) -> FusedTiles:
    """Tiles for the gate/up and down kernels where a one-kernel ("mlp_tma") entry cannot run:
    the portable tiles at the entry's ``block_m``, so a block schedule already built for it
    still fits. A one-kernel entry's own gu_* fields size a whole-head reduction and would not
    fit a K loop's stages. Other tiles come back unchanged."""
    if tiles.gu_variant != "mlp_tma":
        return tiles
    warps = 8 if tiles.block_m >= 128 else 4
    return replace(PORTABLE_TILES, block_m=tiles.block_m, gu_warps=warps, down_warps=warps,
                   sum_block_t=tiles.sum_block_t, sum_warps=tiles.sum_warps).fitted(config)


# ---------------------------------------------------------------------------------------------
# the router's tiles
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingTiles:
    """Block shapes of the fused router's kernels (:mod:`magi_moe.kernels.router`)."""

    block_s: int = 32
    block_d: int = 64
    warps: int = 8
    place_warps: int = 8
    prefix_block_tb: int = 64
    prefix_block_b: int = 32

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_int("RoutingTiles", f.name, getattr(self, f.name), power_of_two=True)

    def fitted(self, config: MoEConfig) -> "RoutingTiles":
        """block_d shrunk to a power of two dividing Dh (a multiple of 16), so no masks."""
        return _fitted_routing(self, config.head_dim)


@lru_cache(maxsize=1024)  # asked on every routed call: dataclasses.replace costs host time
def _fitted_routing(tiles: RoutingTiles, head_dim: int) -> RoutingTiles:
    block_d = max(_divisor_block(head_dim, tiles.block_d), 16)
    return tiles if block_d == tiles.block_d else replace(tiles, block_d=block_d)


INTERPRETER_ROUTING_TILES = RoutingTiles(block_s=64, block_d=256, warps=1,
                                         place_warps=1, prefix_block_tb=256, prefix_block_b=256)


# ---------------------------------------------------------------------------------------------
# the tables
# ---------------------------------------------------------------------------------------------
_warned: set[tuple] = set()


def _warn_once(key: tuple, message: str) -> None:
    """One warning per ``key`` (a device and a table, or an override) in a process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, TileTableWarning, stacklevel=4)


def _known(cls, values: dict, where: str) -> dict:
    """The fields of ``cls`` in ``values`` (a table may carry fields newer code dropped)."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be an object of {cls.__name__} fields, got {values!r}")
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in values.items() if k in names}


@lru_cache(maxsize=None)
def load_device_entry(device_name: str, path: Path | None = None) -> dict | None:
    """This GPU's entry of ``tiles/fused.json`` (written by the tuner, ``python -m tuner``), or
    None when it has none (or there is no file): the first entry whose ``match`` is a substring
    of the name, case ignored."""
    path = path or TILE_TABLE
    if not path.exists():
        log.debug("tile table %s: no such file", path)
        return None
    for entry in json.loads(path.read_text()).get("devices", []):
        if entry["match"].lower() in device_name.lower():
            log.debug("tile table %s: entry %r for %s", path, entry["match"], device_name)
            return entry
    log.debug("tile table %s: no entry matches %s", path, device_name)
    return None


@lru_cache(maxsize=None)
def load_tile_table(device_name: str, path: Path | None = None) -> list[tuple[float, FusedTiles]] | None:
    """The tabled expert-kernel tiles for a GPU: (routes-per-bank upper edge, tiles), sorted."""
    entry = load_device_entry(device_name, path)
    if entry is None:
        return None
    classes = []
    for i, cls in enumerate(entry["classes"]):
        where = f"{path or TILE_TABLE}, entry {entry['match']!r}, classes[{i}].tiles"
        edge = cls["max_routes_per_bank"]
        try:
            tiles = FusedTiles(**_known(FusedTiles, cls["tiles"], where))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        classes.append((math.inf if edge is None else float(edge), tiles))
    return sorted(classes, key=lambda c: c[0])


def write_tile_table(device_match: str, classes: list[tuple[float | None, FusedTiles]], *,
                     routing: dict | None = None, note: str = "", path: Path | None = None) -> Path:
    """Write (or replace) one GPU's entry in ``tiles/fused.json``: the format
    :func:`load_tile_table` reads. ``classes``: (routes-per-bank upper edge or None, tiles)."""
    path = path or TILE_TABLE
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault("format", TABLE_FORMAT)
    entries = [e for e in table.get("devices", []) if e["match"] != device_match]
    entries.append({"match": device_match, "note": note, "classes": [
        {"max_routes_per_bank": None if edge is None or math.isinf(edge) else edge,
         "tiles": asdict(tiles)} for edge, tiles in classes]})
    if routing is not None:
        entries[-1]["routing"] = routing
    table["devices"] = entries
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    load_device_entry.cache_clear()
    load_tile_table.cache_clear()
    choose_routing_tiles.cache_clear()
    return path


@dataclass(frozen=True)
class TileChoice:
    """Which tiles the fused kernels got, and where from. ``source``: "interpreter" (the CPU's
    fixed tiles), "table" (``entry`` of the table at ``path``, the class up to ``edge`` routes
    per bank), "portable" (a GPU the table at ``path`` has no entry for, or no file) or
    "environment" (``MAGI_MOE_FUSED_TILES``)."""

    tiles: FusedTiles
    source: str
    path: Path | None = None
    entry: str | None = None
    edge: float | None = None

    def __str__(self) -> str:
        if self.source == "table":
            upto = "no limit" if math.isinf(self.edge) else f"up to {self.edge:.4g}"
            return f"{self.path}, entry {self.entry!r}, class {upto} routes per bank"
        if self.source == "portable":
            why = "no such file" if not self.path.exists() else "no entry for this GPU"
            return f"PORTABLE_TILES ({self.path}: {why})"
        if self.source == "environment":
            return f"{OVERRIDE_ENV} over PORTABLE_TILES"
        return "INTERPRETER_TILES"


def _override(config: MoEConfig) -> TileChoice | None:
    text = os.environ.get(OVERRIDE_ENV)
    if not text:
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{OVERRIDE_ENV} must be a JSON object of FusedTiles fields: {exc}") from None
    unknown = sorted(set(values) - {f.name for f in fields(FusedTiles)}) if isinstance(values, dict) else None
    if unknown is None or unknown:
        raise ValueError(f"{OVERRIDE_ENV} must be a JSON object of FusedTiles fields, got "
                         f"{text!r}" + (f" (unknown: {unknown})" if unknown else ""))
    try:
        tiles = FusedTiles(**{**asdict(PORTABLE_TILES), **values})
    except ValueError as exc:
        raise ValueError(f"{OVERRIDE_ENV}: {exc}") from None
    _warn_once(("environment", text), f"{OVERRIDE_ENV} is set: the fused kernels use "
               f"{values} over PORTABLE_TILES instead of the tile table (meant for sweeps)")
    return TileChoice(tiles.fitted(config), "environment")


def fused_tile_choice(config: MoEConfig, num_routes: int, device: torch.device) -> TileChoice:
    """Tiles for this shape and device, with where they came from: ``MAGI_MOE_FUSED_TILES``
    (JSON of FusedTiles fields over the portable ones, for sweeps) when set, the interpreter's
    off a GPU, else :func:`gpu_tile_choice` for this GPU's name."""
    override = _override(config)
    if override is not None:
        return override
    if device.type != "cuda":
        return TileChoice(INTERPRETER_TILES.fitted(config), "interpreter")
    return gpu_tile_choice(config, num_routes, torch.cuda.get_device_name(device))


def gpu_tile_choice(config: MoEConfig, num_routes: int, device_name: str,
                    path: Path | None = None) -> TileChoice:
    """The tabled tiles of GPU ``device_name``, looked up by mean routes per bank (the padding
    and the weight reuse both follow it); the portable ones, with a warning once per GPU and
    table, where the table has no entry for it or there is no table."""
    path = path or TILE_TABLE
    classes = load_tile_table(device_name, path)
    if not classes:
        choice = TileChoice(PORTABLE_TILES.fitted(config), "portable", path)
        _warn_once(("fused", device_name, str(path)),
                   f"the fused kernels on {device_name} use {choice}; "
                   f"python -m tuner --anchors --write (from a checkout) tables this GPU")
        return choice
    per_bank = num_routes / max(config.num_banks, 1)
    edge, tiles = next(((e, t) for e, t in classes if per_bank <= e), classes[-1])
    match = load_device_entry(device_name, path)["match"]
    return TileChoice(tiles.fitted(config), "table", path, match, edge)  # fitted: cached


def choose_fused_tiles(config: MoEConfig, num_routes: int, device: torch.device) -> FusedTiles:
    """:func:`fused_tile_choice`'s tiles."""
    return fused_tile_choice(config, num_routes, device).tiles


def gpu_routing_tiles(device_name: str, path: Path | None = None) -> RoutingTiles:
    """The fused router's swept tiles for GPU ``device_name`` (``routing`` in its entry), or the
    defaults with a warning once per GPU and table."""
    path = path or TILE_TABLE
    swept = (load_device_entry(device_name, path) or {}).get("routing")
    if not swept:
        _warn_once(("routing", device_name, str(path)),
                   f"the fused router on {device_name} uses the default RoutingTiles: {path} "
                   f"has no routing tiles for this GPU")
        return RoutingTiles()
    where = f"{path}, routing tiles for {device_name}"
    try:
        return RoutingTiles(**_known(RoutingTiles, swept, where))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


@lru_cache(maxsize=None)
def choose_routing_tiles(config: MoEConfig, device: torch.device) -> RoutingTiles:
    """The interpreter's tiles on the CPU, on a GPU :func:`gpu_routing_tiles`; fitted to the
    config."""
    if device.type != "cuda":
        return INTERPRETER_ROUTING_TILES.fitted(config)
    return gpu_routing_tiles(torch.cuda.get_device_name(device)).fitted(config)


def choose_layer_tiles(config: MoEConfig, num_routes: int,
                       device: torch.device) -> tuple[RoutingTiles, FusedTiles]:
    """The fused layer's two choices at once: the router's tiles (fitted) and the expert
    kernels' for ``num_routes`` routes."""
    return (choose_routing_tiles(config, device).fitted(config),
            choose_fused_tiles(config, num_routes, device))
