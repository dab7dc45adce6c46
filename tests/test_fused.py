"""The fused BF16 path's own promises, beyond the implementation matrix of
``test_implementations.py`` (which holds ``fused`` to the float64 oracle like every path):

* the device-built block schedule (worked example, upper bound, coverage);
* partial route tables, packed vs plain weights, every declared dtype, workspace reuse,
  argument errors;
* int64 addressing past ``token * row_stride = 2^31`` (in a child process: a wrong offset
  kills the interpreter with SIGSEGV);
* the fused router against the torch router: the same experts, the tie rule, NaN last, the
  same CSR table bit for bit;
* the layer's fused path; on CUDA: no host synchronisation, no allocation once warm, the
  docs/ANCHORS.md accuracy target and bitwise repeatability at production size.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import textwrap

import pytest
import torch

from magi_moe.judge import judge
from magi_moe.backends import BACKENDS
from magi_moe.config import MoEConfig, preset
from magi_moe.impls import FUSED
from magi_moe.kernels.tiles import (INTERPRETER_TILES, PORTABLE_TILES, FusedTiles, RoutingTiles,
                                    two_kernel_tiles)
from magi_moe.kernels.workspace import FusedWorkspace
from magi_moe.problems import (Problem, bit_pattern, random_problem, relative_l2, routes_to,
                               run_poisoned, same_bits)
from magi_moe.pytest_plugin import impl_dtype_params
from magi_moe.reference import expert_reference
from magi_moe.routing import Routes, build_route_table, route
from magi_moe.weights import ExpertWeights


@pytest.fixture
def device(triton_device) -> torch.device:
    return triton_device


def F():
    """The kernel module, imported only once a backend is known to be usable."""
    from magi_moe.kernels import fused
    return fused


def launch_block_schedule(*args, **kwargs):
    from magi_moe.kernels.schedule import launch_block_schedule as launch
    return launch(*args, **kwargs)


def poisoned_forward(problem: Problem, weights: ExpertWeights | None = None) -> torch.Tensor:
    from magi_moe.debug import poison_workspaces

    out = torch.full_like(problem.x, float("nan"))
    with poison_workspaces():
        F().fused_forward(problem.x, problem.table, weights or problem.weights, problem.config,
                          out=out)
    return out


# ---------------------------------------------------------------------------------------------
# block schedule
# ---------------------------------------------------------------------------------------------
def test_block_schedule_worked_example(device):
    """The example in kernels/schedule.py's docstring, from offsets and from counts."""
    ws = FusedWorkspace(device)
    offsets = torch.tensor([0, 3, 3, 4], dtype=torch.int64, device=device)
    sched = launch_block_schedule(offsets, 4, 3, 2, ws)
    n = int(sched.block_count)
    assert n == 3 and sched.max_blocks == 2 + 3
    assert sched.block_bank[:n].tolist() == [0, 0, 2]
    assert sched.block_start[:n].tolist() == [0, 2, 3]

    written = torch.full((4,), -5, dtype=torch.int64, device=device)
    counts = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    sched = launch_block_schedule(written, 4, 3, 2, ws, counts=counts)
    assert written.tolist() == [0, 3, 3, 4]
    assert sched.block_bank[:int(sched.block_count)].tolist() == [0, 0, 2]


@pytest.mark.parametrize("from_counts", [False, True], ids=["offsets", "counts"])
@pytest.mark.parametrize("block_m", [1, 16, 64])
def test_block_schedule_covers_every_route_within_the_bound(device, block_m, from_counts):
    """Several programs fill the schedule, each looping over chunks of it (block_m=1 gives over
    three hundred slots: more 64-slot chunks than the interpreter's four programs); from counts,
    the offsets they write must be the CSR cumsum."""
    gen = torch.Generator().manual_seed(block_m)
    counts = torch.randint(0, 3 * block_m, (50,), generator=gen)
    counts[::7] = 0          # empty banks
    counts[3] = 10 * block_m + 301  # a hot bank crossing many block boundaries
    offsets = torch.zeros(51, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    R = int(offsets[-1])
    ws = FusedWorkspace(device)
    if from_counts:
        written = torch.full((51,), -5, dtype=torch.int64, device=device)
        sched = launch_block_schedule(written, R, 50, block_m, ws,
                                            counts=counts.to(torch.int32).to(device))
        assert written.cpu().tolist() == offsets.tolist()
    else:
        sched = launch_block_schedule(offsets.to(device), R, 50, block_m, ws)
    n = int(sched.block_count)
    assert n == int(((counts + block_m - 1) // block_m).sum()) <= sched.max_blocks
    bank = sched.block_bank[:n].cpu().long()
    start = sched.block_start[:n].cpu()
    covered = torch.zeros(R, dtype=torch.int64)
    for b in range(n):
        lo, hi = int(offsets[bank[b]]), int(offsets[bank[b] + 1])
        assert lo <= int(start[b]) < hi, "a block starts outside its bank"
        covered[int(start[b]):min(int(start[b]) + block_m, hi)] += 1
    assert bool((covered == 1).all()), "every route must lie in exactly one block"


# ---------------------------------------------------------------------------------------------
# the expert path
# ---------------------------------------------------------------------------------------------
def test_partial_table_leaves_unrouted_slots_empty(device):
    """A partial table (some (s, h, k) slots have no route): those add nothing, nothing is NaN."""
    cfg = preset("tiny")
    problem = random_problem(cfg, 40, seed=11, device=device)
    keep = torch.arange(problem.table.num_routes, device=device) % 3 != 0
    keep[: 2 * cfg.top_k] = False
    problem = Problem(cfg, problem.x, problem.gate, problem.bias, problem.weights,
                      problem.routes, problem.table.select(keep))
    out = poisoned_forward(problem)
    v = judge(out, problem, FUSED)
    assert v.ok, v.text
    ref = expert_reference(problem.x, problem.table, problem.weights, cfg)
    unrouted = ref == 0
    assert bool(unrouted.any()) and bool((out[unrouted] == 0).all())


def test_packed_and_plain_weights_give_the_same_bits(device):
    from magi_moe.packed_weights import is_packed_pair, pack_expert_weights

    problem = random_problem(preset("small"), 33, seed=12, device=device)
    packed = pack_expert_weights(problem.weights)
    assert is_packed_pair(packed.w_gate, packed.w_up)
    assert torch.equal(poisoned_forward(problem), poisoned_forward(problem, packed))


@pytest.mark.parametrize("variant", [
    dict(gu_variant="kloop", gu_block_n=32, gu_block_k=16, down_block_n=16, down_block_k=32),
    dict(gu_variant="kloop", block_m=32, gu_block_n=64, gu_block_k=16, down_block_k=16),
    dict(gu_variant="mlp_tma", gu_block_n=16),
], ids=["kloop-small-tiles", "kloop-bm32", "mlp-tma"])
@pytest.mark.parametrize("head_dim", [32, 48])  # 48: no one-kernel step (not a power of two)
def test_every_kernel_variant_agrees_with_the_oracle(device, variant, head_dim):
    fused = F()
    cfg = MoEConfig(num_heads=2, head_dim=head_dim, num_experts=4, top_k=2, intermediate_size=64)
    problem = random_problem(cfg, 37, seed=head_dim, device=device)
    tiles = FusedTiles(**{**vars(INTERPRETER_TILES), **variant}).fitted(cfg)
    out = torch.full_like(problem.x, float("nan"))
    fused.fused_forward(problem.x, problem.table, problem.weights, cfg, out=out, tiles=tiles,
                        workspace=FusedWorkspace(device))
    v = judge(out, problem, FUSED)
    assert v.ok, v.text


DESCRIPTOR_KERNELS = ("expert_mlp_tma_kernel",)


def _plan(problem: Problem, tiles, weights: ExpertWeights | None = None):
    """The launch plan fused_forward runs for this problem and these tiles."""
    plan, _ = F().fused_call(problem.x, problem.table, weights or problem.weights, problem.config,
                             tiles=tiles, workspace=FusedWorkspace(problem.x.device))
    return plan


def _descriptor_kernels(plan) -> list[str]:
    return [k for k in plan.kernels if k in DESCRIPTOR_KERNELS]


def _forward_with(problem: Problem, tiles, weights: ExpertWeights | None = None) -> torch.Tensor:
    from magi_moe.debug import poison_workspaces

    fused = F()
    out = torch.full_like(problem.x, float("nan"))
    with poison_workspaces():
        fused.fused_forward(problem.x, problem.table, weights or problem.weights, problem.config,
                            out=out, tiles=tiles, workspace=FusedWorkspace(problem.x.device))
    return out


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
def test_the_one_kernel_step_runs_and_agrees_with_the_two_kernels(device):
    """The plan runs the descriptor kernel (no fallback) and it computes what the two pointer
    kernels compute: the same bits under the interpreter (same operations in the same order),
    the oracle's accuracy on a GPU."""
    from magi_moe.kernels.device import tma_supported

    if not tma_supported(device):
        pytest.skip("tensor descriptors need Hopper or later")
    problem = random_problem(preset("small"), 45, seed=21, device=device)
    base = INTERPRETER_TILES if device.type == "cpu" else PORTABLE_TILES
    # mlp_tma reduces over all of Dh in one dot and over I in steps of gu_block_n: the pointer
    # kernels take the same steps, so the interpreter's sums match.
    pointer = FusedTiles(**{**vars(base), "gu_block_k": 256, "gu_block_n": 32,
                            "down_block_k": 32}).fitted(problem.config)
    descriptor = FusedTiles(**{**vars(pointer), "gu_variant": "mlp_tma"})
    assert _descriptor_kernels(_plan(problem, pointer)) == []
    plan = _plan(problem, descriptor)
    assert plan.reasons == ()
    assert _descriptor_kernels(plan) == ["expert_mlp_tma_kernel"]
    want = _forward_with(problem, pointer)
    got = _forward_with(problem, descriptor)
    if device.type == "cpu":
        assert torch.equal(got, want)
    else:
        v = judge(got, problem, FUSED)
        assert v.ok, v.text


def test_the_one_kernel_step_falls_back_on_unaligned_weights(device):
    """A weight whose base is not 16-byte aligned cannot be a TMA source: the plan runs the
    pointer kernels instead, on the one-kernel entry's fallback tiles, and says why, with the
    same result."""
    problem = random_problem(preset("small"), 29, seed=22, device=device)
    w = problem.weights
    storage = torch.empty(w.w_down.numel() + 1, dtype=w.w_down.dtype, device=device)
    odd = storage[1:].view(w.w_down.shape)  # base 2 bytes past an aligned allocation
    odd.copy_(w.w_down)
    gate_storage = torch.empty(w.w_gate.numel() + 1, dtype=w.w_gate.dtype, device=device)
    odd_gate = gate_storage[1:].view(w.w_gate.shape)
    odd_gate.copy_(w.w_gate)
    weights = ExpertWeights(odd_gate, w.w_up, odd)
    base = INTERPRETER_TILES if device.type == "cpu" else PORTABLE_TILES
    # shaped like the H200 table's one-kernel entries
    descriptor = FusedTiles(**{**vars(base.fitted(problem.config)), "gu_variant": "mlp_tma",
                               "block_m": 128, "gu_block_n": 32, "gu_block_k": 256, "gu_warps": 8})
    pointer = two_kernel_tiles(descriptor, problem.config)
    assert pointer.gu_variant == "kloop" and pointer.block_m == 128
    plan = _plan(problem, descriptor, weights)
    assert plan.kernels == ("block_schedule_kernel", "gate_up_kernel", "down_kernel",
                            "topk_sum_kernel")
    aligned = "base address not 16-byte aligned"
    assert plan.reasons == (f"gu_variant 'mlp_tma' -> gate_up_kernel + down_kernel: "
                            f"w_gate: {aligned}; w_down: {aligned}",)
    assert plan.step("gate_up_kernel").tiles == pointer
    assert torch.equal(_forward_with(problem, descriptor, weights),
                       _forward_with(problem, pointer, weights))


def test_the_interpreter_default_plan_is_the_kloop_and_pointer_pair(device):
    if device.type != "cpu":
        pytest.skip("the interpreter's tiles")
    problem = random_problem(preset("small"), 20, seed=23, device=device)
    plan = _plan(problem, None)
    assert plan.kernels == ("block_schedule_kernel", "gate_up_kernel", "down_kernel",
                            "topk_sum_kernel")
    assert plan.reasons == () and plan.asked == INTERPRETER_TILES.fitted(problem.config)


@pytest.mark.parametrize("inter", [32, 64])
def test_one_kernel_tiles_on_a_single_activation_slice(device, inter):
    """I = gu_block_n leaves the one-kernel loop a single trip; on the H200 Triton 3.6 then asked
    353 KiB of shared memory (found by the int64 test), so the launcher checks the compiled
    kernel and falls back: either way the result must be right, never OutOfResources."""
    cfg = MoEConfig(num_heads=2, head_dim=256, num_experts=4, top_k=2, intermediate_size=inter)
    problem = random_problem(cfg, 24, seed=inter, device=device)
    tiles = FusedTiles(gu_variant="mlp_tma", block_m=128, gu_block_n=32, gu_block_k=256,
                       gu_warps=8, gu_stages=3).fitted(cfg)
    v = judge(_forward_with(problem, tiles), problem, FUSED)
    assert v.ok, v.text


@pytest.mark.parametrize("impl, dtype", impl_dtype_params([FUSED]))
def test_every_declared_dtype(device, impl, dtype):
    problem = random_problem(preset("tiny").replace(dtype=dtype), 50, seed=13, device=device)
    v = judge(run_poisoned(impl, problem), problem, impl)
    assert v.ok, v.text


def test_hot_expert_across_many_blocks(device):
    """Every token of head 0 on experts 0..K-1 (counts S cross several row blocks at every
    block size in use); head 1 spread at random."""
    cfg = preset("tiny")
    S = 3 * 64 + 1
    gen = torch.Generator().manual_seed(14)
    spread = torch.stack([torch.randperm(cfg.num_experts, generator=gen)[:cfg.top_k]
                          for _ in range(S)])
    ids = torch.stack([torch.arange(cfg.top_k).expand(S, -1), spread], dim=1)
    problem = random_problem(cfg, S, seed=14, device=device).with_routes(
        routes_to(ids.to(device), cfg, seed=14))
    assert int(problem.table.counts().max()) == S
    v = judge(poisoned_forward(problem), problem, FUSED)
    assert v.ok, v.text


def test_workspace_is_reused_once_warm(device):
    fused = F()
    problem = random_problem(preset("tiny"), 30, seed=15, device=device)
    ws = FusedWorkspace(device)
    out = torch.empty_like(problem.x)
    fused.fused_forward(problem.x, problem.table, problem.weights, problem.config, out=out,
                        workspace=ws)
    warm = ws.allocations
    fused.fused_forward(problem.x, problem.table, problem.weights, problem.config, out=out,
                        workspace=ws)
    assert ws.allocations == warm, "a warm call must not allocate"
    bigger = random_problem(preset("tiny"), 90, seed=16, device=device)
    fused.fused_forward(bigger.x, bigger.table, bigger.weights, bigger.config, workspace=ws)
    assert ws.allocations > warm



def test_a_captured_workspace_keeps_the_buffers_it_replaces():
    """Once a CUDA graph captured calls on a workspace (``note_capture``), a replay may still
    write its buffers: growing one must keep the old allocation alive, never hand it back to
    the allocator (CONTRACT 8b). Before any capture, a grown buffer is let go."""
    ws = FusedWorkspace("cpu")
    first = ws.get("rows", (8, 4), torch.float32)
    ws.get("rows", (64, 4), torch.float32)
    assert ws._retired == [], "nothing captured yet: the old buffer may be freed"
    ws.captured = True  # what note_capture records while a CUDA graph is capturing
    captured = ws.get("rows", (64, 4), torch.float32)
    ws.get("rows", (512, 4), torch.float32)
    assert any(t.data_ptr() == captured.data_ptr() for t in ws._retired), \
        "a buffer a graph may replay into was released"
    assert first.data_ptr() != captured.data_ptr()

# (id, make the bad call's arguments from a valid problem, message pattern); all ValueError
BAD_ARGUMENTS = [
    pytest.param(lambda p: (p.x.float(), p.table, p.weights, p.config), {}, "x must have dtype",
                 id="x-float32"),
    pytest.param(lambda p: (p.x, p.table, p.weights.to(torch.float16), p.config), {}, "dtype",
                 id="weights-float16"),
    pytest.param(lambda p: (torch.empty(8, 2 * p.config.hidden_size, dtype=p.x.dtype,
                                        device=p.x.device)[:, ::2], p.table, p.weights, p.config),
                 {}, "x must have unit stride", id="x-strided-columns"),
    pytest.param(lambda p: (p.x, dataclasses.replace(p.table, sorted_probs=p.table.sorted_probs.double()),
                            p.weights, p.config), {}, "table.sorted_probs", id="probs-float64"),
    pytest.param(lambda p: (p.x, p.table, p.weights, p.config.replace(top_k=1)), {},
                 "table was built for", id="config-top_k"),
    pytest.param(lambda p: (p.x, p.table, p.weights, p.config),
                 {"out": lambda p: torch.empty(7, p.config.hidden_size, dtype=p.x.dtype,
                                               device=p.x.device)}, "out", id="out-one-row-short"),
]


@pytest.mark.parametrize("make_args, make_kwargs, pattern", BAD_ARGUMENTS)
def test_bad_arguments_name_the_argument(triton_device, make_args, make_kwargs, pattern):
    """Checked before any launch, on a device where the kernels could run."""
    problem = random_problem(preset("tiny"), 8, seed=17, device=triton_device)
    kwargs = {name: make(problem) for name, make in make_kwargs.items()}
    with pytest.raises(ValueError, match=pattern):
        F().fused_forward(*make_args(problem), **kwargs)


INT64_SCRIPT = textwrap.dedent("""
    import torch
    from magi_moe.config import MoEConfig
    from magi_moe.kernels import fused
    from magi_moe.kernels.tiles import choose_fused_tiles
    from magi_moe.kernels.workspace import FusedWorkspace
    from magi_moe.reference import swiglu7
    from magi_moe.routing import RouteTable, Routes, build_route_table
    from magi_moe.weights import random_weights

    # H*Dh = 3072: token * row_stride passes 2^31 from token 699,051 (CONTRACT section 7).
    H, E, Dh = 12, 2, 256
    cfg = MoEConfig(num_heads=H, head_dim=Dh, num_experts=E, top_k=1, intermediate_size=32)
    device = torch.device("{device}")
    S = 700_100
    tokens = torch.tensor([699_049, 699_050, 699_051, 699_052, 700_099])
    x = torch.empty(S, cfg.hidden_size, dtype=torch.bfloat16, device=device)  # untouched pages
    gen = torch.Generator().manual_seed(3)
    x_small = torch.randn(len(tokens), cfg.hidden_size, generator=gen).bfloat16()
    x[tokens.to(device)] = x_small.to(device)
    weights = random_weights(cfg, generator=gen)
    ids = torch.randint(0, E, (len(tokens), H, 1), generator=gen)
    small = build_route_table(Routes(ids, torch.rand(len(tokens), H, 1, generator=gen)), cfg)
    # The same routes over all S tokens: route i of the small table is token tokens[i].
    big_slots = tokens[small.route_slots // H] * H + small.route_slots % H
    table = RouteTable(tokens[small.gather_ids.long()].int().to(device),
                       small.sorted_probs.to(device), small.offsets.to(device),
                       big_slots.to(device), S, H, E, 1)
    rows = torch.empty(table.num_routes, Dh, device=device)
    slot_route = torch.empty(S * H, dtype=torch.int32, device=device)
    fused.launch_route_rows(x, table, weights.to(device), cfg, rows, slot_route,
                            tiles=choose_fused_tiles(cfg, table.num_routes, device),
                            workspace=FusedWorkspace(device))
    want = []
    for r in range(small.num_routes):  # float64 p * expert(x) per route
        i, h = int(small.gather_ids[r]), int(small.route_slots[r]) % H
        f = h * E + int(ids[i, h, 0])
        xs = x_small[i, h * Dh:(h + 1) * Dh].double()
        a = swiglu7(xs @ weights.w_gate[f].double(), xs @ weights.w_up[f].double())
        want.append(float(small.sorted_probs[r]) * (a @ weights.w_down[f].double()))
    want = torch.stack(want)
    err = ((rows.cpu().double() - want).norm() / want.norm()).item()
    assert err < 5e-3, err
    assert torch.equal(slot_route.cpu()[big_slots], torch.arange(table.num_routes, dtype=torch.int32))
    print("ok", err)
""")


def test_int64_offsets_past_2_31(device):
    """Tokens 699,049..700,099 of a 700,100-token input (H*Dh = 3072); on the CPU the 4.3 GB
    input is never touched except at those rows, and the check runs in a child process so that
    an int32 offset (a wild read) shows as a signal instead of killing the test session."""
    from magi_moe.fuzz.child import run_capped

    script = INT64_SCRIPT.format(device=device.type)
    env = {**os.environ, "TRITON_INTERPRET": "1" if device.type == "cpu" else "0"}
    proc = run_capped([sys.executable, "-c", script], env=env, timeout=600,
                      cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, f"child: {proc.end.text}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.startswith("ok")


# ---------------------------------------------------------------------------------------------
# fused routing
# ---------------------------------------------------------------------------------------------
def fused_route(x, gate, bias, cfg, tiles=None):
    from magi_moe.kernels.router import fused_route as run
    return run(x, gate, bias, cfg, workspace=FusedWorkspace(x.device), tiles=tiles)


def assert_same_routing(fr, routes: Routes, cfg: MoEConfig) -> None:
    assert torch.equal(fr.expert_ids.long(), routes.expert_ids)
    torch.testing.assert_close(fr.probs, routes.probs.float(), rtol=2e-6, atol=1e-7)
    want = build_route_table(Routes(routes.expert_ids, fr.probs), cfg)
    difference = fr.table.first_difference(want)
    assert difference is None, difference


@pytest.fixture(params=[True, False], ids=["tuple-picks", "three-reductions"])
def pick_form(request, monkeypatch):
    """Both top-K forms of the fused router on every backend (by default GPUs run the tuple
    reduction and the interpreter three built-in reductions, for speed)."""
    from magi_moe.kernels import router

    monkeypatch.setattr(router, "FORCE_TUPLE_PICKS", request.param)
    return request.param


@pytest.mark.parametrize("name,num_tokens", [("tiny", 1), ("tiny", 97), ("small", 70),
                                             ("small-softmax", 33)])
def test_fused_router_matches_the_torch_router(device, name, num_tokens):
    problem = random_problem(preset(name), num_tokens, seed=num_tokens, device=device)
    cfg = problem.config
    fr = fused_route(problem.x, problem.gate, problem.bias, cfg)
    assert_same_routing(fr, problem.routes, cfg)


def test_fused_router_tie_rule_and_nan_last(device, pick_form):
    """All-equal scores pick experts 0..K-1 in order; -inf selection ranks above NaN, and the
    lower index wins among NaNs (magi_moe.routing's rule), for sigmoid and softmax."""
    cfg = preset("tiny").replace(top_k=8)  # every expert: the whole order shows
    x = torch.randn(5, cfg.hidden_size).bfloat16().to(device)
    gate = torch.zeros(cfg.num_banks, cfg.head_dim, device=device)  # every logit 0: full ties
    # The interpreter runs a tuple reduction's combine in Python, element pair by element pair:
    # an 8-token block instead of its 64 keeps this at seconds.
    tiles = RoutingTiles(block_s=8, block_d=16, warps=1, place_warps=1) \
        if device.type == "cpu" else None
    fr = fused_route(x, gate, None, cfg, tiles=tiles)
    assert bool((fr.expert_ids.long() == torch.arange(8, device=device)).all())
    bias = torch.zeros(cfg.num_banks, device=device)
    bias[[2, 0, 9]] = float("nan")
    bias[[1, 8]] = float("-inf")
    for c in (cfg, cfg.replace(score_func="softmax")):
        fr = fused_route(x, gate, bias, c, tiles=tiles)
        assert_same_routing(fr, route(x, gate, bias, c), c)
        assert fr.expert_ids[0, 0].tolist() == [3, 4, 5, 6, 7, 1, 0, 2]
        assert fr.expert_ids[0, 1].tolist() == [2, 3, 4, 5, 6, 7, 0, 1]


@pytest.mark.parametrize("nan_expert", [0, 9, 15], ids=["first", "middle", "last"])
def test_fused_router_nan_selection_unpicked_is_not_a_route(device, nan_expert, pick_form):
    """K < E with one expert's selection NaN for every token: it ranks last and is never
    picked, so it must hold no route. With E = 16 (the kernel's padded width, so no padded
    experts) the last index once had the same top-K key as a taken expert and was counted as
    one route per token: the table's offsets claimed 8 routes more than were placed."""
    cfg = preset("tiny").replace(num_experts=16, top_k=2)
    gen = torch.Generator().manual_seed(nan_expert)
    x = torch.randn(8, cfg.hidden_size, generator=gen).bfloat16().to(device)
    gate = (torch.randn(cfg.num_banks, cfg.head_dim, generator=gen) / 4).to(device)
    bias = torch.zeros(cfg.num_banks, device=device)
    bias[nan_expert] = float("nan")  # head 0
    fr = fused_route(x, gate, bias, cfg)
    assert_same_routing(fr, route(x, gate, bias, cfg), cfg)
    assert int(fr.table.counts()[nan_expert]) == 0


def test_fused_router_nan_gate_row_under_softmax_spares_the_head(device):
    """A NaN gate row under softmax (CONTRACT section 1): that expert alone ranks last and is
    never picked, the head's other experts keep their torch-router scores; nothing is NaN."""
    cfg = preset("small-softmax")
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, cfg.hidden_size, generator=gen).bfloat16().to(device)
    gate = (torch.randn(cfg.num_banks, cfg.head_dim, generator=gen) / 4).to(device)
    gate[4] = float("nan")  # head 0, expert 4
    fr = fused_route(x, gate, None, cfg)
    assert_same_routing(fr, route(x, gate, None, cfg), cfg)
    assert int(fr.table.counts()[4]) == 0
    assert not torch.isnan(fr.probs).any()


def test_fused_router_both_pick_forms_agree(device, monkeypatch):
    """The tuple reduction and the three built-in reductions: bitwise the same routes."""
    from magi_moe.kernels import router

    problem = random_problem(preset("tiny"), 33, seed=5, device=device)
    cfg = problem.config
    picked = []
    for form in (True, False):
        monkeypatch.setattr(router, "FORCE_TUPLE_PICKS", form)
        fr = fused_route(problem.x, problem.gate, problem.bias, cfg)
        picked.append((fr.expert_ids.clone(), fr.probs.clone(), fr.table.offsets.clone()))
    for a, b in zip(*picked):
        assert same_bits(a, b)


def test_fused_router_empty_input(device):
    cfg = preset("tiny")
    x = torch.empty(0, cfg.hidden_size, dtype=torch.bfloat16, device=device)
    gate = torch.randn(cfg.num_banks, cfg.head_dim, device=device)
    fr = fused_route(x, gate, None, cfg)
    assert fr.table.num_routes == 0 and bool((fr.table.offsets == 0).all())


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------
def fused_layer(cfg: MoEConfig, device, seed: int = 0):
    from magi_moe.layer import MagiMoE

    torch.manual_seed(seed)
    layer = MagiMoE(cfg, impl="fused", device=device)
    with torch.no_grad():
        layer.router.expert_bias_ema.normal_(0.0, 0.05)
    return layer


def test_layer_fused_path_matches_the_oracle(device):
    cfg = preset("small")
    layer = fused_layer(cfg, device)
    x = torch.randn(45, cfg.hidden_size, device=device).bfloat16()
    y = layer(x)
    routes = route(x, layer.gate, layer.selection_bias, cfg)
    problem = Problem(cfg, x, layer.gate.detach(), layer.selection_bias,
                      ExpertWeights(*(w.detach() for w in layer.expert_weights())), routes,
                      build_route_table(routes, cfg))
    assert y.dtype == x.dtype and y.shape == x.shape
    v = judge(y, problem, FUSED)
    assert v.ok, v.text
    assert torch.equal(layer(x), y), "the layer path must be bitwise repeatable"


def test_dispatch_picks_fused_for_16_bit_kernels(device):
    from magi_moe.dispatch import choose_implementation

    for deterministic in (False, True):
        assert choose_implementation(device, torch.bfloat16, deterministic=deterministic).name == "fused"
    assert choose_implementation(device, torch.float16).name == "fused"
    assert choose_implementation(device, torch.float32).name == "native"
    assert choose_implementation(device, torch.float32, deterministic=True).name == "native-det"


# ---------------------------------------------------------------------------------------------
# CUDA only
# ---------------------------------------------------------------------------------------------
@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.cuda)])
def cuda_only(request) -> torch.device:
    """A CUDA property (host sync, allocator, production size): the cuda backend alone, so the
    interpreter gets no row to skip."""
    why = BACKENDS[request.param].unavailable_reason()
    if why:
        pytest.skip(f"backend {request.param} unavailable: {why}")
    return torch.device(BACKENDS[request.param].device)


def production_problem(device, heads=3, tokens=4096):
    from magi_moe.bench.cases import BenchCase, draw_problem
    return draw_problem(BenchCase(heads, tokens, seed=5), device)


def test_no_host_sync_once_warm(cuda_only):
    from magi_moe.packed_weights import pack_expert_weights

    problem = production_problem(cuda_only, tokens=512)
    fused = F()
    packed = pack_expert_weights(problem.weights)
    out = torch.empty_like(problem.x)
    layer = fused_layer(problem.config, cuda_only)
    for _ in range(2):  # warm: compile, grow workspaces
        fused.fused_forward(problem.x, problem.table, packed, problem.config, out=out)
        layer(problem.x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused.fused_forward(problem.x, problem.table, packed, problem.config, out=out)
        layer(problem.x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_no_allocation_once_warm(cuda_only):
    from magi_moe.packed_weights import pack_expert_weights

    problem = production_problem(cuda_only, tokens=512)
    fused = F()
    packed = pack_expert_weights(problem.weights)
    out = torch.empty_like(problem.x)
    layer = fused_layer(problem.config, cuda_only)
    for _ in range(2):
        fused.fused_forward(problem.x, problem.table, packed, problem.config, out=out)
        layer(problem.x)
    torch.cuda.synchronize()
    count = lambda: torch.cuda.memory_stats()["allocation.all.allocated"]  # noqa: E731
    before = count()
    fused.fused_forward(problem.x, problem.table, packed, problem.config, out=out)
    assert count() == before, "the kernel-level path allocated once warm"
    before = count()
    layer(problem.x)
    assert count() == before + 1, "the layer path may allocate its output and nothing else"


def test_production_accuracy_and_bitwise_repeatability(cuda_only):
    """docs/ANCHORS.md: relative L2 <= 3.0e-3 at H=3, S=4096 (public best 2.88e-3); 20 runs of the
    layer (routing included) bitwise identical."""
    from magi_moe.packed_weights import pack_expert_weights

    problem = production_problem(cuda_only)
    packed = pack_expert_weights(problem.weights)
    out = F().fused_forward(problem.x, problem.table, packed, problem.config)
    ref = expert_reference(problem.x, problem.table, problem.weights, problem.config)
    assert relative_l2(out, ref) <= 3.0e-3
    layer = fused_layer(problem.config, cuda_only)
    first = layer(problem.x)
    for _ in range(20):
        assert torch.equal(layer(problem.x), first)


# ---------------------------------------------------------------------------------------------
# the launch plan never changes a token's bits (what bitwise expert parallelism rests on)
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(BACKENDS["cuda"].unavailable_reason() is not None,
                    reason=f"cuda: {BACKENDS['cuda'].unavailable_reason()}")
@pytest.mark.parametrize("config_name,tokens", [("magi2-ep4-local", 700), ("small", 300)])
def test_every_launch_plan_gives_the_same_bits(config_name, tokens):
    """Every tabled class's tiles, other one-kernel tiles, the two-kernel fallbacks (pointer and
    descriptor) and row-strided weights: bit for bit the output of the tiles this problem gets.
    A rank of an EP group gets other tiles than the whole layer (other route counts per bank),
    so a difference here is a difference between EP and one process."""
    from magi_moe.kernels.tiles import choose_fused_tiles, load_tile_table

    device = torch.device("cuda")
    problem = random_problem(preset(config_name), tokens, seed=31, device=device, gate_std=1 / 16)
    cfg = problem.config
    tabled = choose_fused_tiles(cfg, problem.table.num_routes, device)
    classes = [t.fitted(cfg) for _, t in (load_tile_table(torch.cuda.get_device_name()) or [])]
    two = two_kernel_tiles(dataclasses.replace(tabled, gu_variant="mlp_tma"), cfg)
    plans = {f"class {i}": t for i, t in enumerate(classes)}
    one = dataclasses.replace(tabled, gu_variant="mlp_tma", gu_block_k=cfg.head_dim)
    plans.update({
        "portable": PORTABLE_TILES.fitted(cfg),
        "one kernel bm64": dataclasses.replace(one, block_m=64, gu_warps=4).fitted(cfg),
        "one kernel bn16": dataclasses.replace(one, gu_block_n=16, gu_stages=4).fitted(cfg),
        "one kernel 2 stages": dataclasses.replace(one, gu_stages=2).fitted(cfg),
        "two kernels": two,
        "two kernels bm64 bk32": dataclasses.replace(two, block_m=64, gu_block_k=32, gu_warps=4,
                                                     down_warps=4),
    })
    want = _forward_with(problem, tabled)
    assert not torch.isnan(want).any()
    for name, tiles in plans.items():
        got = _forward_with(problem, tiles)
        differ = int((bit_pattern(got) != bit_pattern(want)).sum())
        assert differ == 0, f"{name} ({tiles}): {differ} of {got.numel()} elements differ"
    strided = ExpertWeights(*(torch.empty(*w.shape[:-1], w.shape[-1] + 32, dtype=w.dtype,
                                          device=device)[..., :w.shape[-1]].copy_(w)
                              for w in problem.weights))
    got = _forward_with(problem, tabled, strided)
    assert same_bits(got, want), "row-strided weights differ"
