"""The fused path's launch plan, decided on the host before anything launches: which kernels
run on a GPU this machine does not have (the device's facts are passed in), and why a fallback
was taken. Nothing here launches a kernel; the weights are CPU tensors, only their layout
matters."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")

import torch

from magi_moe.config import MoEConfig, preset
from magi_moe.kernels import plan as P
from magi_moe.kernels.device import DeviceFacts
from magi_moe.kernels.expert_mlp import EXPERT_MLP
from magi_moe.kernels.gate_up_down import DOWN, GATE_UP
from magi_moe.kernels.launch_steps import Launcher
from magi_moe.kernels.plan import plan_fused
from magi_moe.kernels.schedule import max_blocks
from magi_moe.kernels.tiles import PORTABLE_TILES, FusedTiles, two_kernel_tiles
from magi_moe.kernels.topk_sum import TOPK_SUM
from magi_moe.weights import ExpertWeights, random_weights

H200 = DeviceFacts(tma=True, shared_memory=232448, multiprocessors=132)
A100 = DeviceFacts(tma=False, shared_memory=166912, multiprocessors=108)
INTERPRETER = DeviceFacts(tma=True, shared_memory=None, multiprocessors=None)
ONE_KERNEL = FusedTiles(block_m=128, gu_block_n=32, gu_block_k=256, gu_warps=8, gu_stages=3,
                        gu_variant="mlp_tma", sum_block_t=8)  # the H200 table's shape


def _weights(cfg: MoEConfig, *, unaligned: tuple[str, ...] = ()) -> ExpertWeights:
    w = random_weights(cfg, generator=torch.Generator().manual_seed(0))
    moved = {}
    for name in unaligned:
        t = getattr(w, name)
        storage = torch.empty(t.numel() + 1, dtype=t.dtype)
        moved[name] = storage[1:].view(t.shape)  # 2 bytes past an aligned allocation
    return w._replace(**moved)


def _never_measured(step):
    raise AssertionError(f"measured {step.kernel} although the plan had refused it already")


def test_one_kernel_on_hopper():
    cfg = preset("magi2-full").replace(num_heads=3, num_experts=16)
    S, R = 4096, 4096 * 3 * cfg.top_k
    tiles = ONE_KERNEL.fitted(cfg)
    measured = []
    plan = plan_fused(cfg, S, R, tiles, H200, _weights(cfg),
                      shared_memory_of=lambda step: measured.append(step) or 200 * 1024)
    assert plan.kernels == ("block_schedule_kernel", "expert_mlp_tma_kernel", "topk_sum_kernel")
    assert plan.reasons == () and not plan.clear_slots
    nb = max_blocks(R, cfg.num_banks, 128)
    assert plan.max_blocks == nb and plan.activation_rows == 0
    assert plan.step("expert_mlp_tma_kernel").grid == 132  # persistent: one per multiprocessor
    assert plan.step("topk_sum_kernel").grid == S * 3 // 8
    assert [s.kernel for s in measured] == ["expert_mlp_tma_kernel"]
    built = plan_fused(cfg, S, R, tiles, H200, _weights(cfg), schedule_built=True, rows_only=True)
    assert built.kernels == ("expert_mlp_tma_kernel",)


def test_no_tma_before_hopper_runs_the_two_kernels_on_their_tiles():
    cfg = preset("small")
    plan = plan_fused(cfg, 100, 1200, ONE_KERNEL.fitted(cfg), A100, _weights(cfg),
                      shared_memory_of=_never_measured)
    assert plan.kernels == ("block_schedule_kernel", "gate_up_kernel", "down_kernel",
                            "topk_sum_kernel")
    assert plan.reasons == ("gu_variant 'mlp_tma' -> gate_up_kernel + down_kernel: "
                            "no TMA (tensor descriptors) before Hopper",)
    fallback = two_kernel_tiles(ONE_KERNEL.fitted(cfg), cfg)
    assert plan.step("gate_up_kernel").tiles == fallback == plan.step("down_kernel").tiles
    assert plan.activation_rows == plan.max_blocks * 128


def test_a_head_width_not_a_power_of_two_takes_the_two_kernels():
    cfg = MoEConfig(num_heads=2, head_dim=96, num_experts=8, top_k=2, intermediate_size=128)
    plan = plan_fused(cfg, 50, 200, ONE_KERNEL.fitted(cfg), H200, _weights(cfg),
                      shared_memory_of=_never_measured)
    assert plan.reasons == ("gu_variant 'mlp_tma' -> gate_up_kernel + down_kernel: "
                            "head_dim 96 is not a power of two in 16..256",)
    assert "expert_mlp_tma_kernel" not in plan.kernels


def test_a_compiled_kernel_over_the_shared_memory_takes_the_two_kernels():
    """The footprint Triton 3.6 asked at I = BLOCK_N (353 KiB) against the H200's 227 KiB."""
    cfg = MoEConfig(num_heads=2, head_dim=256, num_experts=4, top_k=2, intermediate_size=32)
    plan = plan_fused(cfg, 24, 96, ONE_KERNEL.fitted(cfg), H200, _weights(cfg),
                      shared_memory_of=lambda step: 353 * 1024)
    assert plan.reasons == ("gu_variant 'mlp_tma' -> gate_up_kernel + down_kernel: "
                            "expert_mlp_tma_kernel compiled for these tiles needs 353.0 KiB of "
                            "shared memory > the GPU's 227.0 KiB",)
    # the interpreter has no compiled kernel to measure: never asked
    plan = plan_fused(cfg, 24, 96, ONE_KERNEL.fitted(cfg), INTERPRETER, _weights(cfg),
                      shared_memory_of=_never_measured)
    assert plan.reasons == () and "expert_mlp_tma_kernel" in plan.kernels


def test_each_weight_the_one_kernel_reads_is_checked_for_descriptors():
    """An unaligned ``w_up`` sends the one-kernel step to the two kernels; a ``w_down`` with
    padded rows is fine where its row stride is a multiple of 16 bytes, refused otherwise."""
    cfg = preset("small")
    tiles = ONE_KERNEL.fitted(cfg)
    plan = plan_fused(cfg, 100, 1200, tiles, H200, _weights(cfg, unaligned=("w_up",)),
                      shared_memory_of=_never_measured)
    assert plan.kernels == ("block_schedule_kernel", "gate_up_kernel", "down_kernel",
                            "topk_sum_kernel")
    assert plan.reasons == ("gu_variant 'mlp_tma' -> gate_up_kernel + down_kernel: w_up: base "
                            "address not 16-byte aligned",)
    assert plan.step("gate_up_kernel").tiles.gu_variant == "kloop"
    strided = _weights(cfg)
    padded = torch.empty(cfg.num_banks, cfg.intermediate_size, cfg.head_dim + 8,
                         dtype=strided.w_down.dtype)[..., :cfg.head_dim]  # 144-byte rows: fine
    assert plan_fused(cfg, 100, 1200, tiles, H200, strided._replace(w_down=padded)).reasons == ()
    odd = torch.empty(cfg.num_banks, cfg.intermediate_size, cfg.head_dim + 4,
                      dtype=strided.w_down.dtype)[..., :cfg.head_dim]
    plan = plan_fused(cfg, 100, 1200, tiles, H200, strided._replace(w_down=odd))
    assert plan.reasons == ("gu_variant 'mlp_tma' -> gate_up_kernel + down_kernel: w_down: row "
                            "stride of 136 bytes not a multiple of 16",)


def test_grids_follow_the_device():
    cfg = preset("small")
    tiles = PORTABLE_TILES.fitted(cfg)
    for facts, cap in ((H200, 132), (INTERPRETER, 4)):
        plan = plan_fused(cfg, 1000, 12000, tiles, facts, _weights(cfg))
        work = plan.max_blocks * (cfg.intermediate_size // tiles.gu_block_n)
        assert plan.step("gate_up_kernel").grid == min(work, cap)
    twice = FusedTiles(gu_programs_per_sm=2).fitted(cfg)
    assert plan_fused(cfg, 1000, 12000, twice, H200, _weights(cfg)).step("gate_up_kernel").grid == 264


def test_no_routes_leaves_only_the_sum_over_cleared_slots():
    cfg = preset("tiny")
    plan = plan_fused(cfg, 10, 0, PORTABLE_TILES.fitted(cfg), H200, _weights(cfg))
    assert plan.kernels == ("topk_sum_kernel",) and plan.clear_slots and plan.max_blocks == 0
    partial = plan_fused(cfg, 10, 10 * cfg.num_heads * cfg.top_k - 1, PORTABLE_TILES.fitted(cfg),
                         H200, _weights(cfg))
    assert partial.clear_slots
    assert not plan_fused(cfg, 10, 0, PORTABLE_TILES, H200, _weights(cfg), rows_only=True).steps


def test_only_keeps_the_named_launches_in_order():
    cfg = preset("small")
    plan = plan_fused(cfg, 100, 1200, PORTABLE_TILES.fitted(cfg), H200, _weights(cfg))
    part = plan.only("topk_sum_kernel", "gate_up_kernel")
    assert part.kernels == ("gate_up_kernel", "topk_sum_kernel")
    assert plan.only(TOPK_SUM, GATE_UP).steps == part.steps  # launchers name the same steps
    assert plan.step(DOWN) is plan.step("down_kernel")
    with pytest.raises(KeyError, match="not 'expert_mlp_tma_kernel'"):
        plan.step(EXPERT_MLP)


@pytest.mark.parametrize("field,value,expected", [
    ("tma", 1, "DeviceFacts.tma must be a bool, got 1"),
    ("shared_memory", 0, "DeviceFacts.shared_memory must be a positive int or None, got 0"),
    ("multiprocessors", 13.5, "DeviceFacts.multiprocessors must be a positive int or None, got 13.5"),
])
def test_bad_device_facts_are_refused(field, value, expected):
    facts = {"tma": True, "shared_memory": 1024, "multiprocessors": 4, field: value}
    with pytest.raises(ValueError) as raised:
        DeviceFacts(**facts)
    assert str(raised.value) == expected


def _call():
    from magi_moe.kernels.launch_steps import FusedCall
    from magi_moe.kernels.workspace import FusedWorkspace
    from magi_moe.problems import random_problem

    p = random_problem(preset("tiny"), 4, seed=1)
    return FusedCall(p.x, p.table, p.weights, p.config, FusedWorkspace("cpu"), None,
                     torch.empty(0), torch.empty(0))


def test_run_plan_launches_each_step_by_the_launcher_it_carries():
    from magi_moe.kernels.fused import run_plan

    launched = []
    first = Launcher("first_kernel", lambda step, call: launched.append((step.kernel, step.grid)))
    second = Launcher("second_kernel", lambda step, call: launched.append((step.kernel, step.grid)))
    plan = P.LaunchPlan((P.LaunchStep(second, 2, PORTABLE_TILES),
                         P.LaunchStep(first, 1, PORTABLE_TILES)), PORTABLE_TILES, INTERPRETER, 0)
    run_plan(plan, _call())
    assert launched == [("second_kernel", 2), ("first_kernel", 1)]


def test_a_descriptor_step_without_its_descriptors_is_refused():
    from magi_moe.kernels.fused import run_plan

    plan = P.LaunchPlan((P.LaunchStep(EXPERT_MLP, 1, ONE_KERNEL),), ONE_KERNEL, INTERPRETER, 0)
    with pytest.raises(ValueError, match="call.descriptors has none for expert_mlp_tma_kernel"):
        run_plan(plan, _call())
