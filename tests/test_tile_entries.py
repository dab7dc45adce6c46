"""Every tile choice the fused path can make is judged against the float64 oracle, not only the
one the table picks for the shapes other tests happen to draw:

* each class of each GPU entry of ``kernels/tiles/fused.json``, at a shape it serves (mean
  routes per bank inside its class, the table lookup confirming it picks that class): on CUDA
  at the production widths, under the interpreter at ``tiny``'s;
* the interpreter's own tiles and the portable ones (a GPU without an entry);
* the fused router on each entry's routing tiles, the default and the interpreter's, judged
  against the float64 router;
* each fallback of the launch plan (``kernels/plan.py``), forced and confirmed by the reason the
  plan gives: no TMA (the device's facts patched), a head width not a power of two, unaligned
  weights, a one-kernel step over the GPU's shared memory (facts patched, CUDA only: only a
  compiled kernel is measured);
* that these choices between them reach every expert kernel the package defines: a kernel none
  of them reaches is dead code, to be removed, not kept untested.

Each run writes into a NaN output with NaN workspaces on used memory (as the harness runs).
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")

import torch

from magi_moe.judge import judge
from magi_moe.backends import BACKENDS
from magi_moe.config import MoEConfig, preset
from magi_moe.debug import poison_workspaces
from magi_moe.dirty_memory import handed_memory, reserve_for
from magi_moe.impls import FUSED
from magi_moe.kernels.tiles import (INTERPRETER_ROUTING_TILES, INTERPRETER_TILES, PORTABLE_TILES,
                                    TILE_TABLE, FusedTiles, RoutingTiles, choose_fused_tiles,
                                    gpu_tile_choice, two_kernel_tiles)
from magi_moe.kernels.workspace import FusedWorkspace
from magi_moe.problems import Problem, random_problem, routes_to
from magi_moe.routing import Routes, build_route_table
from magi_moe.weights import ExpertWeights


def _table_classes() -> list[tuple[str, int, float, float, FusedTiles]]:
    """(entry match, class index, lower edge, upper edge, tiles) of every tabled class."""
    found = []
    for entry in json.loads(TILE_TABLE.read_text()).get("devices", []):
        lower = 0.0
        for i, cls in enumerate(entry["classes"]):
            edge = math.inf if cls["max_routes_per_bank"] is None else cls["max_routes_per_bank"]
            found.append((entry["match"], i, lower, edge, FusedTiles(**cls["tiles"])))
            lower = edge
    return found


CLASSES = _table_classes()
CLASS_IDS = [f"{match}-class{i}" for match, i, *_ in CLASSES]


def _backend(name: str) -> torch.device:
    why = BACKENDS[name].unavailable_reason()
    if why:
        pytest.skip(f"backend {name} unavailable: {why}")
    return torch.device(BACKENDS[name].device)


@pytest.fixture(params=[pytest.param("interpret", marks=pytest.mark.interpret),
                        pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    return _backend(request.param)


def F():
    from magi_moe.kernels import fused
    return fused


def served_tokens(cfg: MoEConfig, lower: float, edge: float) -> int:
    """Tokens whose mean routes per bank lie inside ``(lower, edge]``: the middle of a bounded
    class, one and a half times the lower edge of the last."""
    want = (lower + edge) / 2 if math.isfinite(edge) else 1.5 * max(lower, 1.0)
    return max(1, round(want * cfg.num_experts / cfg.top_k))


def draw(cfg: MoEConfig, tokens: int, device: torch.device, seed: int) -> Problem:
    if device.type == "cuda":  # the production widths' weights, drawn on the GPU
        from magi_moe.bench.cases import BenchCase, draw_problem
        case = BenchCase(cfg.num_heads, tokens, experts=cfg.num_experts, top_k=cfg.top_k,
                         head_dim=cfg.head_dim, inter=cfg.intermediate_size, seed=seed)
        return draw_problem(case, device)
    return random_problem(cfg, tokens, seed=seed, device=device)


def width_config(device: torch.device) -> MoEConfig:
    """Production widths on a GPU; ``tiny``'s under the interpreter."""
    return preset("magi2-ep4-local") if device.type == "cuda" else preset("tiny")


def run_judged(problem: Problem, tiles: FusedTiles, weights: ExpertWeights | None = None):
    """The plan ``tiles`` get on this problem, after running them poisoned and judging them."""
    fused, device = F(), problem.x.device
    weights = weights or problem.weights
    plan, _ = fused.fused_call(problem.x, problem.table, weights, problem.config, tiles=tiles,
                               workspace=FusedWorkspace(device))
    out = torch.full_like(problem.x, float("nan"))
    reserve = reserve_for(problem.config, problem.num_tokens, problem.table.num_routes)
    with poison_workspaces(), handed_memory(device, reserve_bytes=reserve):
        fused.fused_forward(problem.x, problem.table, weights, problem.config, out=out,
                            tiles=tiles, workspace=FusedWorkspace(device))
    v = judge(out, problem, FUSED, label=f"tiles {tiles}")
    assert v.ok, f"{plan}\n{v.text}"
    return plan


# ---------------------------------------------------------------------------------------------
# the table's entries, at the shapes they serve
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("match,index,lower,edge,tiles", CLASSES, ids=CLASS_IDS)
def test_each_tabled_class_at_a_shape_it_serves(device, match, index, lower, edge, tiles):
    # the interpreter: tiny's widths on 8 banks of top-4 routes (a class is a count of routes
    # per bank: fewer banks reach it with fewer routes)
    cfg = (width_config(device) if device.type == "cuda"
           else preset("tiny").replace(num_experts=4, top_k=4))
    tokens = served_tokens(cfg, lower, edge)
    routes = tokens * cfg.num_heads * cfg.top_k
    choice = gpu_tile_choice(cfg, routes, match)
    assert (choice.entry, choice.edge) == (match, edge), f"{tokens} tokens are not served by class {index}"
    assert choice.tiles == tiles.fitted(cfg)
    problem = draw(cfg, tokens, device, seed=50 + index)
    plan = run_judged(problem, choice.tiles)
    if device.type == "cuda" and match.lower() in torch.cuda.get_device_name(device).lower():
        assert plan.reasons == (), f"the table's own GPU falls back: {plan.reasons}"


def test_the_interpreter_tiles_at_several_shapes():
    """The interpreter's fixed tiles serve every shape: one token, experts without tokens, and
    several row blocks per expert."""
    device = _backend("interpret")
    for cfg, tokens in ((preset("tiny"), 1), (preset("tiny"), 37), (preset("tiny"), 90)):
        problem = random_problem(cfg, tokens, seed=tokens, device=device)
        assert choose_fused_tiles(cfg, problem.table.num_routes, device) == \
            INTERPRETER_TILES.fitted(cfg)
        assert run_judged(problem, INTERPRETER_TILES.fitted(cfg)).reasons == ()


@pytest.mark.parametrize("tokens", [1, 100])
def test_the_portable_tiles(device, tokens):
    """A GPU without a table entry runs :data:`PORTABLE_TILES` at every shape."""
    problem = draw(width_config(device), tokens, device, seed=70 + tokens)
    assert run_judged(problem, PORTABLE_TILES.fitted(problem.config)).reasons == ()


def _routing_choices() -> list[tuple[str, RoutingTiles]]:
    """Every router tile set the fused layer can take: each table entry's, the default one (a GPU
    whose entry has none) and the interpreter's."""
    found = [(f"{e['match']}-routing", RoutingTiles(**e["routing"]))
             for e in json.loads(TILE_TABLE.read_text()).get("devices", []) if e.get("routing")]
    return found + [("default", RoutingTiles()), ("interpreter", INTERPRETER_ROUTING_TILES)]


@pytest.mark.parametrize("name,routing", _routing_choices(), ids=[n for n, _ in _routing_choices()])
def test_each_routing_tile_choice_against_the_float64_router(device, name, routing):
    """The fused router on each tile set: its choices and weights judged against the float64
    router, its CSR table the one its routes make. Several row and bank blocks: 300 tokens."""
    from magi_moe.audit.router_judge import judge_router
    from magi_moe.kernels.router import fused_route

    if name == "interpreter" and device.type == "cuda":  # one warp over 256-wide blocks: the
        pytest.skip("interpreter's tiles only")           # compile alone outlasted 3 minutes
    problem = draw(width_config(device), 300, device, seed=80)
    cfg = problem.config
    tiles = routing.fitted(cfg)
    got = fused_route(problem.x, problem.gate, problem.bias, cfg, tiles=tiles,
                      workspace=FusedWorkspace(device))
    routes = Routes(got.expert_ids.long(), got.probs)  # the layer's int32 ids, widened
    v = judge_router(routes, problem.x, problem.gate, problem.bias, cfg, subject=f"{name} {tiles}")
    assert v.ok, [c.text for c in v.checks if not c.ok]
    want = build_route_table(routes, cfg)
    difference = got.table.first_difference(want)
    assert difference is None, difference
    # control: one (token, head) given its last choice twice is refused by the same judge
    ids = routes.expert_ids.clone()
    ids[0, 0, 0] = ids[0, 0, -1]
    bad = judge_router(Routes(ids, routes.probs), problem.x, problem.gate, problem.bias, cfg)
    assert not bad.ok


# ---------------------------------------------------------------------------------------------
# the launch plan's fallbacks, each forced
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def facts_patch(monkeypatch):
    """``patch(**fields)``: the fused path plans with this device's facts, fields replaced."""
    fused = F()
    real = fused.device_facts

    def patch(**fields):
        monkeypatch.setattr(fused, "device_facts",
                            lambda dev: dataclasses.replace(real(dev), **fields))
    return patch


def _unaligned(w: torch.Tensor) -> torch.Tensor:
    storage = torch.empty(w.numel() + 1, dtype=w.dtype, device=w.device)
    return storage[1:].view(w.shape).copy_(w)  # base 2 bytes past an aligned allocation


def _one_kernel() -> list[FusedTiles]:
    """The tabled one-kernel tiles (each distinct), or the H200 shape where the table has none."""
    tiles = {t for *_, t in CLASSES if t.gu_variant == "mlp_tma"}
    return sorted(tiles, key=str) or [FusedTiles(block_m=128, gu_block_n=32, gu_block_k=256,
                                                 gu_warps=8, gu_variant="mlp_tma", sum_block_t=8)]


def _fallback_problem(device: torch.device, cfg: MoEConfig | None = None) -> Problem:
    cfg = cfg or width_config(device)
    return draw(cfg, 700 if device.type == "cuda" else 80, device, seed=60)


def _reasons_of(plan) -> str:
    return " | ".join(plan.reasons)


@pytest.mark.parametrize("cause", ["no TMA", "head width", "unaligned weights", "shared memory"])
def test_one_kernel_fallbacks(device, facts_patch, cause):
    """``mlp_tma`` -> gate/up + down on :func:`two_kernel_tiles`, for each cause."""
    if cause == "shared memory" and device.type != "cuda":
        pytest.skip("only a compiled kernel's shared memory is measured")
    cfg = None
    if cause == "head width":
        cfg = width_config(device).replace(head_dim=192 if device.type == "cuda" else 48)
    problem = _fallback_problem(device, cfg)
    weights = None
    if cause == "no TMA":
        facts_patch(tma=False)
    elif cause == "unaligned weights":
        weights = problem.weights._replace(w_gate=_unaligned(problem.weights.w_gate))
    elif cause == "shared memory":
        facts_patch(shared_memory=16 * 1024)
    expected = {"no TMA": "no TMA", "head width": "is not a power of two in 16..256",
                "unaligned weights": "w_gate: base address not 16-byte aligned",
                "shared memory": "KiB of shared memory > the GPU's 16.0 KiB"}[cause]
    # the interpreter takes one (the plan's choice does not depend on the tiles' sizes)
    for tiles in _one_kernel() if device.type == "cuda" else _one_kernel()[-1:]:
        tiles = tiles.fitted(problem.config)
        plan = run_judged(problem, tiles, weights)
        assert plan.reasons and plan.reasons[0].startswith("gu_variant 'mlp_tma' -> gate_up_kernel "
                                                           "+ down_kernel: ")
        assert expected in plan.reasons[0], _reasons_of(plan)
        assert plan.step("gate_up_kernel").tiles == two_kernel_tiles(tiles, problem.config)


def _launchers() -> set:
    """Every :class:`~magi_moe.kernels.launch_steps.Launcher` the kernels package defines."""
    import importlib
    import pkgutil

    import magi_moe.kernels as K
    from magi_moe.kernels.launch_steps import Launcher

    found = set()
    for info in pkgutil.iter_modules(K.__path__):
        module = importlib.import_module(f"magi_moe.kernels.{info.name}")
        found |= {v for v in vars(module).values() if isinstance(v, Launcher)}
    return found


def test_every_expert_kernel_is_reached_by_a_tile_choice_or_a_fallback():
    """Why each kernel the launch plan can run is kept, as the plans (no launch) of the choices
    judged above: the table's classes on Hopper (``expert_mlp_tma_kernel``), the portable and
    interpreter tiles (``gate_up_kernel`` + ``down_kernel``, which are also the one-kernel
    step's fallback on a GPU without TMA), the schedule and the top-k sum in all of them."""
    from magi_moe.kernels.device import DeviceFacts
    from magi_moe.kernels.plan import plan_fused
    from magi_moe.weights import random_weights

    hopper = DeviceFacts(tma=True, shared_memory=232448, multiprocessors=132)
    before_hopper = dataclasses.replace(hopper, tma=False)
    cfg = preset("small")  # a power-of-two head width: only the weights' layout matters here
    weights = random_weights(cfg, generator=torch.Generator().manual_seed(0))
    tokens = 512
    routes = tokens * cfg.num_heads * cfg.top_k
    choices = [(t.fitted(cfg), hopper) for *_, t in CLASSES]
    choices += [(PORTABLE_TILES.fitted(cfg), hopper), (INTERPRETER_TILES.fitted(cfg), hopper)]
    choices += [(t.fitted(cfg), before_hopper) for t in _one_kernel()]  # the fallback
    reached = {s.launcher for tiles, facts in choices
               for s in plan_fused(cfg, tokens, routes, tiles, facts, weights).steps}
    assert {k.name for k in reached} >= {"expert_mlp_tma_kernel", "gate_up_kernel", "down_kernel"}
    unreached = sorted(k.name for k in _launchers() - reached)
    assert not unreached, f"no tile choice or fallback launches {unreached}: remove them"


def test_a_fallback_on_tiles_that_miss_the_schedule_is_caught(device, facts_patch, monkeypatch):
    """Planted bug: a fallback whose tiles halve ``block_m`` (the block schedule was built for the
    asked one, so half of each block's rows are never computed) fails the judge."""
    from magi_moe.kernels import plan as P

    real = P.two_kernel_tiles
    monkeypatch.setattr(P, "two_kernel_tiles", lambda tiles, cfg: dataclasses.replace(
        real(tiles, cfg), block_m=real(tiles, cfg).block_m // 2))
    facts_patch(tma=False)
    problem = _fallback_problem(device)
    cfg, tokens = problem.config, problem.num_tokens
    hot = torch.arange(cfg.top_k).expand(tokens, cfg.num_heads, cfg.top_k)  # experts 0..K-1
    problem = problem.with_routes(routes_to(hot.to(problem.x.device), cfg, seed=61))
    assert problem.num_tokens > 64  # a bank with more routes than half a 128-row block
    tiles = _one_kernel()[-1].fitted(problem.config)
    with monkeypatch.context() as unpatched:
        unpatched.setattr(P, "two_kernel_tiles", real)
        run_judged(problem, tiles)  # the true fallback passes on the same problem
    with pytest.raises(AssertionError, match="gate_up_kernel"):
        run_judged(problem, tiles)
