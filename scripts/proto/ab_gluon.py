"""A/B on the H200: the Triton one-kernel path against the Gluon prototypes (scripts/proto/
gluon_mlp.py, the variants in VARIANTS) on the docs/ANCHORS.md cases: the expert rows bit for
bit against the tabled Triton kernel's, then each kernel alone timed (CUDA events, 512 MiB
zeroed before every call, median of 30 after 5 warm-up). NOTES-perf.md, versions 8 and 9, has
the results.

    PYTHONPATH=. python scripts/proto/ab_gluon.py [--case 3,4096] [--variants rs-64,t2-128]
"""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from magi_moe.bench.cases import ANCHOR_CASES, BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.kernel_level import KernelLevel  # noqa: E402
from magi_moe.bench.timing import time_one  # noqa: E402
from magi_moe.kernels import fused as F  # noqa: E402
from magi_moe.kernels.plan import EXPERT_MLP  # noqa: E402
import gluon_mlp  # noqa: E402
import gluon_sd  # noqa: E402
import gluon_ws  # noqa: E402


def gluon_launcher(kernel, call, tiles, stages, grid, **consts):
    cfg, w, sched = call.config, call.weights, call.schedule
    block_bank, block_start, block_count = sched.block_bank, sched.block_start, sched.block_count
    dh, inter, bn = cfg.head_dim, cfg.intermediate_size, tiles.gu_block_n
    gate_rows = dh // 2 if "GU_SLOTS" in consts else dh  # the transposed kernel: half-Dh units
    meta = dict(consts) if "GU_SLOTS" in consts else dict(consts, STAGES=stages)

    def desc(t, rows, block):
        two = t.reshape(rows, t.shape[-1])
        return TensorDescriptor(two, list(two.shape), list(two.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
    banks = cfg.num_banks
    dg = desc(w.w_gate, banks * dh, [gate_rows, bn])
    du = desc(w.w_up, banks * dh, [gate_rows, bn])
    # the split-D kernel (gluon_sd.py) loads W_down in [BLOCK_N, Dh/2] boxes
    dd = desc(w.w_down, banks * inter, [bn, dh // 2 if "SPLIT_D" in consts else dh])
    t = call.table

    pair_args = ()
    if "CONSUMER_REGS" in consts:  # the warp-specialised kernel: its pair schedule, made here
        blocks = int(block_count.item())
        first, second = gluon_ws.build_pairs(block_bank, blocks)
        count = torch.tensor([first.numel()], dtype=torch.int32, device=first.device)
        pair_args = (first, second, count)
        same = int((second >= 0).logical_and(
            block_bank[second.clamp(min=0).long()] == block_bank[first.long()]).sum())
        print(f"  pairs {first.numel()} (one bank {same}) for {blocks} blocks", flush=True)

    def run(rows):
        kernel[(grid,)](
            call.x, dg, du, dd, t.gather_ids, t.sorted_probs, t.route_slots, t.offsets,
            block_bank, block_start, block_count, rows, call.slot_route,
            call.x.stride(0), rows.stride(0), cfg.num_experts, *pair_args,
            HEAD_DIM=dh, INTER=inter, BLOCK_M=tiles.block_m, BLOCK_N=bn,
            num_warps=tiles.gu_warps, **meta)
    return run


VARIANTS = {
    # name: (kernel, block_m, block_n, warps, programs per SM, stages, constexprs);
    # block_m None: the tabled tiles
    "rs-64": ("expert_mlp_gluon_kernel", 64, 16, 4, 2, 3, {"X_IN_REGISTERS": True}),
    "t2-64": ("expert_mlp_gluon_t2_kernel", 64, 64, 4, 1, None, {"GU_SLOTS": 6}),
    "t2-128": ("expert_mlp_gluon_t2_kernel", 128, 64, 8, 1, None, {"GU_SLOTS": 4}),
    # warp-specialised: one producer warpgroup, two 64-row consumers sharing weight streams
    "ws-64": ("expert_mlp_gluon_ws_kernel", 64, 16, 4, 1, 6, {"CONSUMER_REGS": 232}),
    "ws-64-regs": ("expert_mlp_gluon_ws_kernel", 64, 16, 4, 1, 8,
                   {"CONSUMER_REGS": 240, "X_IN_REGISTERS": True}),
    # 8 warps: consumer 0 also issues the fills (no producer partition, no setmaxnreg)
    "ws2-64": ("expert_mlp_gluon_ws2_kernel", 64, 16, 4, 1, 6, {"CONSUMER_REGS": 256}),
    "ws2-64-regs": ("expert_mlp_gluon_ws2_kernel", 64, 16, 4, 1, 8,
                    {"CONSUMER_REGS": 256, "X_IN_REGISTERS": True}),
    # split-D: two 4-warp partitions on one 64-row block, each half of the output columns
    "sd-64": ("expert_mlp_gluon_sd_kernel", 64, 32, 4, 1, 3, {"SPLIT_D": True}),
    "sd-64-plain-u": ("expert_mlp_gluon_sd_kernel", 64, 32, 4, 1, 3,
                      {"SPLIT_D": True, "U_SWIZZLE": False}),
    # split-D, the partitions on alternate slices (no fp32 exchange)
    "sdi-64": ("expert_mlp_gluon_sdi_kernel", 64, 32, 4, 1, 3, {"SPLIT_D": True}),
}


def made(level, tiles):
    """One fused run on ``tiles`` (its own workspace and block schedule), done."""
    plan, call = level.call(tiles)
    F.run_plan(plan, call)
    return plan, call


def main():
    """``--case H,S``: one case only (e.g. for Nsight Compute); ``--variants a,b``: of VARIANTS."""
    cases = ANCHOR_CASES
    if "--case" in sys.argv:
        cases = (tuple(int(v) for v in sys.argv[sys.argv.index("--case") + 1].split(",")),)
    names = list(VARIANTS)
    if "--variants" in sys.argv:
        names = sys.argv[sys.argv.index("--variants") + 1].split(",")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timing = dict(warmup=5, iters=30, flush_mib=512, device=device)
    for heads, tokens in cases:
        level = KernelLevel.of(draw_problem(BenchCase(heads, tokens), device))
        tabled = level.tiles()
        plan, call = made(level, tabled)
        torch.cuda.synchronize()
        want = call.rows.clone()
        step = plan.step(EXPERT_MLP)
        line = [f"H={heads},S={tokens} tabled bm{tabled.block_m} bn{tabled.gu_block_n}"]
        t_ms = time_one(lambda: F._launch_expert_mlp(step, call), **timing)
        line.append(f"triton {t_ms:.3f}")
        for name in names:
            kname, bm, bn, warps, per_sm, stages, consts = VARIANTS[name]
            if bm is None:
                tiles, per_sm = tabled, tabled.gu_programs_per_sm
            else:
                tiles = replace(tabled, block_m=bm, gu_block_n=bn, gu_warps=warps,
                                gu_programs_per_sm=per_sm)
            # its own block schedule, made by a plan of the tabled Triton kernel's kind
            call_tiles = replace(tabled, block_m=tiles.block_m, gu_block_n=16,
                                 gu_warps=4 if tiles.block_m == 64 else 8)
            _, vcall = made(level, call_tiles)
            module = gluon_ws if "_ws" in kname else gluon_sd if "_sd" in kname else gluon_mlp
            run = gluon_launcher(getattr(module, kname), vcall, tiles, stages,
                                 sms * per_sm, **consts)
            rows = torch.full_like(want, float("nan"))
            run(rows)
            torch.cuda.synchronize()
            differ = int((rows.view(torch.int32) != want.view(torch.int32)).sum())
            g_ms = time_one(lambda: run(vcall.rows), **timing)
            line.append(f"{name} {g_ms:.3f} (differ {differ})")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
