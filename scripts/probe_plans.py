"""Issue-13 probes on one GPU, one JSON: where the layer's time goes and whether the fused path's
bits depend on the launch plan.  python scripts/probe_plans.py OUT.json [invariance,layer,tiles]

invariance  one ANCHORS-draw problem through every launch plan the fused path can take (the
            tabled one-kernel tiles, other one-kernel tiles, the two-kernel pointer and
            descriptor variants): mismatching elements against the tabled plan.
layer       the fused layer at S=512 / 4096: GPU time of each kernel (profiler), host time
            per eager call, eager vs CUDA-graph replay vs torch.compile(reduce-overhead),
            all with the L2 flushed before each call (CUDA events, medians).
tiles       one-kernel candidate tiles on the ANCHORS draw (each checked bitwise against
            the tabled plan before it is timed).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch

from magi_moe.bench.cases import BenchCase, draw_problem
from magi_moe.bench.timing import summarize, time_paths
from magi_moe.kernels import fused as F
from magi_moe.kernels.tiles import choose_fused_tiles, two_kernel_tiles
from magi_moe.kernels.workspace import FusedWorkspace
from magi_moe.packed_weights import pack_expert_weights

DEV = torch.device("cuda")
TIMING = dict(warmup=10, iters=60, flush_mib=512, device=DEV)


def median_ms(fn) -> float:
    return summarize(time_paths({"k": fn}, **TIMING)["k"])["median_ms"]


def plans(config):
    tabled = choose_fused_tiles(config, 1, DEV)
    one = lambda **kw: replace(tabled, gu_variant="mlp_tma", **kw).fitted(config)  # noqa: E731
    two = two_kernel_tiles(tabled, config)
    return {
        "tabled": tabled,
        "mlp bm64 w4": one(block_m=64, gu_warps=4),
        "mlp bn16": one(gu_block_n=16, gu_stages=4),
        "mlp stages2": one(gu_stages=2),
        "two-kernel kloop": two,
        "two-kernel bm64 bk32": replace(two, block_m=64, gu_block_k=32, gu_warps=4, down_warps=4),
        "tma_gathered + down tma": replace(two, gu_variant="tma_gathered", down_variant="tma"),
        "tma weights": replace(two, gu_variant="tma"),
    }


def invariance(report):
    out = {}
    for case in (BenchCase(3, 4096), BenchCase(12, 1000)):
        p = draw_problem(case, DEV)
        packed = pack_expert_weights(p.weights)
        results = {}
        for name, tiles in plans(p.config).items():
            try:
                y = F.fused_forward(p.x, p.table, packed, p.config, tiles=tiles,
                                    workspace=FusedWorkspace(DEV))
                results[name] = y.view(torch.int16).clone()
            except Exception as exc:  # noqa: BLE001 -- a plan that cannot run is reported
                results[name] = f"{type(exc).__name__}: {exc}"[:200]
        base = results["tabled"]
        out[case.label] = {n: (r if isinstance(r, str) else int((r != base).sum()))
                           for n, r in results.items()}
        # Contiguous vs row-strided weights (the same values through another layout).
        strided = [torch.empty(w.shape[0], w.shape[1], w.shape[2] + 64, dtype=w.dtype,
                               device=DEV)[:, :, :w.shape[2]].copy_(w) for w in p.weights]
        from magi_moe.weights import ExpertWeights
        y = F.fused_forward(p.x, p.table, ExpertWeights(*strided), p.config)
        out[case.label]["row-strided weights (tabled)"] = int((y.view(torch.int16) != base).sum())
    report["invariance"] = out


def layer(report):
    from magi_moe.bench.paths import _layer
    from magi_moe.impls import FUSED

    out = {}
    for tokens in (512, 4096):
        p = draw_problem(BenchCase(3, tokens), DEV)
        lay = _layer(p, FUSED)
        x = p.x
        for _ in range(5):
            lay(x)
        torch.cuda.synchronize()
        # host time per eager call (no sync inside): launch-side cost
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            lay(x)
        host_us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        # kernels
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                lay(x)
            torch.cuda.synchronize()
        kernels = {e.key: round(e.device_time / 1e3, 4) for e in prof.key_averages()
                   if e.device_time > 0}
        # CUDA graph of the eager layer
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                lay(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            yg = lay(x)
        torch._dynamo.reset()
        comp = torch.compile(lay, mode="reduce-overhead", fullgraph=True)
        for _ in range(4):
            yc = comp(x)
        torch.cuda.synchronize()
        eager = lay(x)
        g.replay()
        torch.cuda.synchronize()
        fns = {"eager": lambda: lay(x), "graph replay": g.replay, "compiled": lambda: comp(x)}
        times = {k: summarize(v)["median_ms"] for k, v in time_paths(fns, **TIMING).items()}
        out[f"S={tokens}"] = {"host_us_per_eager_call": round(host_us, 1), "kernel_ms": kernels,
                              "ms": times,
                              "graph_bitwise": bool(torch.equal(yg.view(torch.int16), eager.view(torch.int16))),
                              "compiled_bitwise": bool(torch.equal(yc.view(torch.int16), eager.view(torch.int16)))}
    report["layer"] = out


def tiles(report):
    out = {}
    for case in (BenchCase(3, 512), BenchCase(3, 4096), BenchCase(3, 16384), BenchCase(12, 4096)):
        p = draw_problem(case, DEV)
        packed = pack_expert_weights(p.weights)
        tabled = choose_fused_tiles(p.config, p.table.num_routes, DEV)
        ws = FusedWorkspace(DEV)
        base = F.fused_forward(p.x, p.table, packed, p.config, tiles=tabled, workspace=ws).clone()
        cands = {"tabled": tabled}
        for bm, w, bn, st, pp in ((128, 8, 32, 3, 1), (64, 4, 32, 3, 1), (64, 4, 32, 4, 1),
                                  (64, 4, 16, 4, 1), (64, 4, 16, 3, 2), (64, 4, 16, 2, 2),
                                  (64, 4, 32, 2, 2), (128, 8, 16, 2, 2), (64, 8, 32, 3, 1),
                                  (64, 8, 32, 4, 1), (64, 4, 64, 2, 1)):
            cands[f"bm{bm} bn{bn} w{w} st{st} pp{pp}"] = replace(
                tabled, block_m=bm, gu_block_n=bn, gu_warps=w, gu_stages=st,
                gu_programs_per_sm=pp)
        row = {}
        for name, t in cands.items():
            try:
                y = F.fused_forward(p.x, p.table, packed, p.config, tiles=t, workspace=ws)
                same = torch.equal(y.view(torch.int16), base.view(torch.int16))
                ms = round(median_ms(lambda t=t: F.fused_forward(
                    p.x, p.table, packed, p.config, tiles=t, workspace=ws)), 4)
                row[name] = ms if same else f"{ms} (bits differ)"
            except Exception as exc:  # noqa: BLE001
                row[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
        out[case.label] = row
        print(case.label, json.dumps(row), flush=True)
    report["tiles"] = out


def routing(report):
    """The fused router's tile candidates on the ANCHORS draw: each one's time, and whether its
    routes and probabilities equal the tabled tiles' bit for bit (block_d orders the logits'
    sums, so they may not: one routing entry per GPU keeps every problem on the same order).
    Session 5's comparison with the previous router (FMA logits, four reductions per pick) is
    in NOTES-perf.md."""
    from magi_moe.kernels import fused_routing as FR
    from magi_moe.kernels.tiles import RoutingTiles

    out = {}
    for case in (BenchCase(3, 512), BenchCase(3, 4096), BenchCase(3, 16384), BenchCase(12, 4096)):
        p = draw_problem(case, DEV)
        ws = FusedWorkspace(DEV)
        new = FR.fused_route(p.x, p.gate, p.bias, p.config, block_m=128, workspace=ws)
        want = (new.expert_ids.clone(), new.probs.clone())
        row = {"tabled ms": round(median_ms(lambda: FR.fused_route(
            p.x, p.gate, p.bias, p.config, block_m=128, workspace=ws)), 4)}
        for bs, bd, w in ((16, 32, 4), (32, 32, 4), (32, 32, 8), (64, 32, 8), (16, 64, 4),
                          (32, 64, 8), (64, 16, 8), (128, 32, 8)):
            rt = RoutingTiles(block_s=bs, block_d=bd, warps=w, place_warps=4)
            try:
                got = FR.fused_route(p.x, p.gate, p.bias, p.config, block_m=128, workspace=ws,
                                     tiles=rt)
                same = bool(torch.equal(got.probs.view(torch.int32), want[1].view(torch.int32))
                            and torch.equal(got.expert_ids, want[0]))
                ms = round(median_ms(lambda rt=rt: FR.fused_route(
                    p.x, p.gate, p.bias, p.config, block_m=128, workspace=ws, tiles=rt)), 4)
                row[f"s{bs} d{bd} w{w}"] = ms if same else f"{ms} (bits differ)"
            except Exception as exc:  # noqa: BLE001
                row[f"s{bs} d{bd} w{w}"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        out[case.label] = row
        print(case.label, json.dumps(row), flush=True)
    report["routing"] = out


def host(report):
    """Host time of one eager fused-layer call at S=512: back to back, one call onto an idle GPU
    (the host's own issue time), and the top functions (cProfile)."""
    import cProfile
    import io
    import pstats

    from magi_moe.bench.paths import _layer
    from magi_moe.impls import FUSED

    p = draw_problem(BenchCase(3, 512), DEV)
    lay = _layer(p, FUSED)
    for _ in range(10):
        lay(p.x)
    torch.cuda.synchronize()
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        lay(p.x)
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    # One call issued onto an idle GPU: the host's own time (back to back, the launch queue
    # fills and the loop above measures the GPU instead once the GPU is the slower side).
    issue = []
    for _ in range(100):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lay(p.x)
        issue.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    issue.sort()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        lay(p.x)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    buf2 = io.StringIO()
    pstats.Stats(prof, stream=buf2).sort_stats("cumulative").print_stats(40)
    report["host"] = {"us_per_call": round(host_us, 1),
                      "issue_us_median": round(issue[len(issue) // 2], 1),
                      "issue_us_min": round(issue[0], 1), "tottime": buf.getvalue()[-6000:],
                      "cumulative": buf2.getvalue()[-7000:]}


if __name__ == "__main__":
    path = sys.argv[1]
    steps = (sys.argv[2] if len(sys.argv) > 2 else "invariance,layer,tiles").split(",")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for step in steps:
        t0 = time.time()
        try:
            globals()[step](report)
        except Exception:  # noqa: BLE001 -- keep the other steps' results
            import traceback
            report[step] = {"error": traceback.format_exc()[-3000:]}
        print(f"{step}: {time.time() - t0:.1f} s", flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print(json.dumps(report, indent=1, default=str)[:6000])
