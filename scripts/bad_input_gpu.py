"""Bad input on the GPU: refused before any kernel launches, and what the checks cost.

    python scripts/bad_input_gpu.py sanitize [--control]
    python scripts/bad_input_gpu.py cost [--preset magi2-ep4-local] [--tokens 4096] [--json PATH]

``sanitize`` (run it under ``compute-sanitizer --tool memcheck``): a few malformed inputs of each
class that used to reach a kernel (strided index tensors, a trusted table edited in place, a
stale fused-router table, route slots naming another head, a half-failed checkpoint load) on
every implementation, each of which must raise ValueError; then valid calls of every
implementation and of the layer, checked against the reference, so the CUDA context is shown
healthy afterwards. Exit status 0 only if every case was refused and every valid call was right.
``--control`` runs one bad table through the bare native launcher (no checks): the sanitizer must
report its wild read and write, which shows the sanitizer run can see one at all.

``cost``: the fused layer path at S=4096 (CUDA events per call, median after warm-up) with the
input checks and with them patched out, the checks' host time per call, the trusted vs validated
expert path, and whether a warm layer forward and a trusted ``fused_forward`` host-sync
(``torch.cuda.set_sync_debug_mode("error")``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from magi_moe.judge import judge  # noqa: E402
from magi_moe.config import preset  # noqa: E402
from magi_moe.layer import MagiMoE  # noqa: E402
from magi_moe.problems import random_problem  # noqa: E402
from magi_moe.registry import get_implementation  # noqa: E402
from magi_moe.routing import build_route_table, check_routes, route  # noqa: E402

IMPLS = ("reference", "torch-bf16", "native", "native-det", "fused")


# ---------------------------------------------------------------------------------------------
# sanitize
# ---------------------------------------------------------------------------------------------
def _strided(t: torch.Tensor) -> torch.Tensor:
    wide = torch.full((t.numel(), 2), -(10**6), dtype=t.dtype, device=t.device)
    wide[:, 0] = t
    return wide[:, 0]


def _bad_tables():
    """(name, make a bad table from a fresh trusted one)."""
    def edited(p):
        p.table.gather_ids[0] = 10**8
        return p.table

    def strided(p):
        return dataclasses.replace(p.table, gather_ids=_strided(p.table.gather_ids))

    def other_head(p):
        slots = p.table.route_slots.clone()
        K = p.config.top_k
        a, b = int((slots == 0).nonzero()[0]), int((slots == K).nonzero()[0])
        slots[a], slots[b] = K, 0
        return dataclasses.replace(p.table, route_slots=slots)

    def stale(p):
        from magi_moe.kernels.router import fused_route
        first = fused_route(p.x, p.gate, p.bias, p.config).table
        fused_route(torch.cat([p.x, p.x, p.x]), p.gate, p.bias, p.config)
        return first

    return [("strided gather_ids", strided), ("trusted table edited in place", edited),
            ("slots naming another head", other_head), ("stale fused-router table", stale)]


def sanitize(control: bool, device: torch.device) -> int:
    cfg = preset("tiny")
    if control:
        p = random_problem(cfg, 64, seed=0, device=device)
        p.table.gather_ids[0] = 10**8
        from magi_moe.kernels.native import launch_native  # the bare launcher: no checks
        print("control: a wild gather index with the checks bypassed (the sanitizer must report it)")
        acc = torch.zeros(p.x.shape, dtype=torch.float32, device=device)
        launch_native(p.x, p.table, p.weights, cfg, acc, deterministic=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print("control: returned (a sanitizer that reports nothing here sees nothing)")
        return 0

    failures, refused = [], 0
    for name in IMPLS:
        impl = get_implementation(name)
        for case, make in _bad_tables():
            p = random_problem(cfg, 64, seed=1, device=device)
            table = make(p)
            out = torch.full(p.x.shape, float("nan"), dtype=impl.output_dtype(p.x.dtype), device=device)
            try:
                impl(p.x, table, p.weights, cfg, out=out)
                failures.append(f"{name}: {case}: not refused")
            except ValueError as exc:
                refused += 1
                print(f"refused  {name:11s} {case}: {str(exc)[:90]}")
            if not torch.isnan(out).all():
                failures.append(f"{name}: {case}: out was written before the refusal")
    layer = MagiMoE(cfg, device=device)
    x = torch.randn(64, cfg.hidden_size, device=device).bfloat16()
    before = layer(x)
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    sd["W_down"] = sd["W_down"].float()
    sd["W_gate"] = torch.randn_like(sd["W_gate"])
    try:
        layer.load_state_dict(sd, assign=True)
        failures.append("layer: load_state_dict(assign=True) with a float32 W_down: not refused")
    except ValueError as exc:
        refused += 1
        print(f"refused  layer       load_state_dict(assign=True), W_down float32: {str(exc)[:70]}")
    if not torch.equal(layer(x), before):
        failures.append("layer: output changed after a refused load")

    # the context is healthy: every implementation right on valid input
    p = random_problem(cfg, 64, seed=2, device=device)
    for name in IMPLS:
        impl = get_implementation(name)
        verdict = judge(impl(p.x, p.table, p.weights, cfg), p, impl)
        print(f"valid    {name:11s} {verdict.text.splitlines()[0]}")
        if not verdict.ok:
            failures.append(f"{name}: wrong on valid input after the refusals: {verdict.text}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    for f in failures:
        print("FAIL", f)
    print(f"sanitize: {refused} malformed calls refused, {len(failures)} failure(s)")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# cost
# ---------------------------------------------------------------------------------------------
def median_ms(fn, *, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, calls: int = 2000) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def host_syncs(fn) -> str:
    """"none", or the first line of the error the sync debug mode raised."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0][:160]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()


@contextlib.contextmanager
def checks_patched_out():
    """The layer path's input checks replaced by no-ops (measurement only)."""
    from magi_moe.kernels import fused_layer, router
    saved = (fused_layer.check_layer_inputs, router.increment_version)
    fused_layer.check_layer_inputs = lambda *a, **k: None
    router.increment_version = lambda *a, **k: None
    try:
        yield
    finally:
        fused_layer.check_layer_inputs, router.increment_version = saved


def cost(preset_name: str, tokens: int, warmup: int, iters: int, json_path: str | None) -> int:
    from magi_moe.kernels.fused import check_fused_inputs, fused_forward

    device = torch.device("cuda")
    cfg = preset(preset_name)
    torch.manual_seed(0)
    layer = MagiMoE(cfg, device=device)
    x = torch.randn(tokens, cfg.hidden_size, device=device).to(cfg.dtype)
    assert layer.implementation(x).name == "fused", "the layer path under test is the fused one"
    res: dict[str, object] = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                  preset=preset_name, tokens=tokens, warmup=warmup, iters=iters)
    with torch.no_grad():
        run = lambda: layer(x)  # noqa: E731
        res["layer_ms_with_checks"] = median_ms(run, warmup=warmup, iters=iters)
        with checks_patched_out():
            res["layer_ms_checks_patched_out"] = median_ms(run, warmup=warmup, iters=iters)
        res["layer_ms_with_checks_again"] = median_ms(run, warmup=warmup, iters=iters)
        res["layer_host_sync"] = host_syncs(run)

        routes = route(x, layer.gate, layer.selection_bias, cfg)
        table = build_route_table(routes, cfg)
        weights = layer.expert_weights()
        out = torch.empty_like(x)
        trusted = lambda: fused_forward(x, table, weights, cfg, out=out)  # noqa: E731
        hand = dataclasses.replace(table)  # same values, untrusted: validated on every call
        validated = lambda: fused_forward(x, hand, weights, cfg, out=out)  # noqa: E731
        res["fused_forward_ms_trusted_table"] = median_ms(trusted, warmup=warmup, iters=iters)
        res["fused_forward_ms_validated_table"] = median_ms(validated, warmup=warmup, iters=iters)
        res["fused_forward_trusted_host_sync"] = host_syncs(trusted)
        res["check_routes_ms"] = median_ms(lambda: check_routes(routes, cfg), warmup=warmup,
                                           iters=iters)
        from torch.autograd.graph import increment_version
        res["host_us_check_fused_inputs"] = host_us(
            lambda: check_fused_inputs(x, table, weights, cfg, check_bounds=False))
        res["host_us_trusted_property"] = host_us(lambda: table.trusted)
        bufs = (table.gather_ids, table.sorted_probs, table.offsets, table.route_slots)
        res["host_us_four_version_bumps"] = host_us(lambda: [increment_version(b) for b in bufs])
    for key, value in res.items():
        print(f"{key:36s} {value:.4f}" if isinstance(value, float) else f"{key:36s} {value}")
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=2))
    ok = res["layer_host_sync"] == "none" and res["fused_forward_trusted_host_sync"] == "none"
    print("cost: no host sync on the layer path and the trusted path" if ok else
          "cost: FAIL, a host sync on a path that promises none")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sanitize")
    s.add_argument("--control", action="store_true")
    s.add_argument("--device", default="cuda",
                   help="cpu: a dry run under TRITON_INTERPRET=1 (no sanitizer)")
    c = sub.add_parser("cost")
    c.add_argument("--preset", default="magi2-ep4-local")
    c.add_argument("--tokens", type=int, default=4096)
    c.add_argument("--warmup", type=int, default=20)
    c.add_argument("--iters", type=int, default=200)
    c.add_argument("--json")
    args = parser.parse_args()
    if args.cmd == "sanitize" and args.device == "cpu":
        return sanitize(args.control, torch.device("cpu"))
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.cmd == "sanitize":
        return sanitize(args.control, torch.device(args.device))
    return cost(args.preset, args.tokens, args.warmup, args.iters, args.json)


if __name__ == "__main__":
    sys.exit(main())
