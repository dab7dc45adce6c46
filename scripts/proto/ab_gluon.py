"""A/B on the H200: the Triton one-kernel path against the Gluon prototype (scripts/proto/
gluon_mlp.py) on the docs/ANCHORS.md cases, on the tabled tiles: the expert rows bit for bit,
then each kernel alone timed (CUDA events, 512 MiB zeroed before every call, median of 30 after
5 warm-up). NOTES-perf.md, version 8, has the results.

    PYTHONPATH=. python scripts/proto/ab_gluon.py        # a Hopper GPU, Triton 3.6's Gluon
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from magi_moe.bench.cases import ANCHOR_CASES, BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.timing import time_one  # noqa: E402
from magi_moe.kernels import fused as F  # noqa: E402
from magi_moe.kernels.plan import EXPERT_MLP  # noqa: E402
from magi_moe.kernels.tiles import choose_fused_tiles  # noqa: E402
from magi_moe.kernels.workspace import FusedWorkspace  # noqa: E402
from magi_moe.packed_weights import pack_expert_weights  # noqa: E402
import gluon_mlp  # noqa: E402


def gluon_launcher(kernel, call, tiles, stages, grid):
    cfg, w, sched = call.config, call.weights, call.schedule
    dh, inter, bn = cfg.head_dim, cfg.intermediate_size, tiles.gu_block_n

    def desc(t, rows, block):
        two = t.reshape(rows, t.shape[-1])
        return TensorDescriptor(two, list(two.shape), list(two.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
    banks = cfg.num_banks
    dg = desc(w.w_gate, banks * dh, [dh, bn])
    du = desc(w.w_up, banks * dh, [dh, bn])
    dd = desc(w.w_down, banks * inter, [bn, dh])
    t = call.table

    def run(rows):
        kernel[(grid,)](
            call.x, dg, du, dd, t.gather_ids, t.sorted_probs, t.route_slots, t.offsets,
            sched.block_bank, sched.block_start, sched.block_count, rows, call.slot_route,
            call.x.stride(0), rows.stride(0), cfg.num_experts,
            HEAD_DIM=dh, INTER=inter, BLOCK_M=tiles.block_m, BLOCK_N=bn, STAGES=stages,
            num_warps=tiles.gu_warps)
    return run


def main():
    """``--case H,S``: one case only (e.g. for Nsight Compute)."""
    cases = ANCHOR_CASES
    if "--case" in sys.argv:
        cases = (tuple(int(v) for v in sys.argv[sys.argv.index("--case") + 1].split(",")),)
    device = torch.device("cuda")
    timing = dict(warmup=5, iters=30, flush_mib=512, device=device)
    for heads, tokens in cases:
        p = draw_problem(BenchCase(heads, tokens), device)
        cfg = p.config
        weights = pack_expert_weights(p.weights)
        tiles = choose_fused_tiles(cfg, p.table.num_routes, device).fitted(cfg)
        ws = FusedWorkspace(device)
        out = torch.empty_like(p.x)
        plan, call = F.fused_call(p.x, p.table, weights, cfg, out=out, tiles=tiles, workspace=ws)
        F.run_plan(plan, call)
        torch.cuda.synchronize()
        want = call.rows.clone()
        step = plan.step(EXPERT_MLP)
        triton_run = lambda: F._launch_expert_mlp(step, call)  # noqa: E731
        line = [f"H={heads},S={tokens} bm{tiles.block_m} bn{tiles.gu_block_n} w{tiles.gu_warps}"]
        t_ms = time_one(triton_run, **timing)
        line.append(f"triton {t_ms:.3f}")
        per_sm, stages = tiles.gu_programs_per_sm, 3
        grid = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
        run = gluon_launcher(gluon_mlp.expert_mlp_gluon_kernel, call, tiles, stages, grid)
        rows = torch.full_like(want, float("nan"))
        run(rows)
        torch.cuda.synchronize()
        differ = int((rows.view(torch.int32) != want.view(torch.int32)).sum())
        g_ms = time_one(lambda: run(call.rows), **timing)
        line.append(f"gluon s{stages} pp{per_sm} {g_ms:.3f} (differ {differ})")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
