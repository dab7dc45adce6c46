"""What the compiler made of the fused router's top-K kernel, without a GPU: screen routing tiles
(or a change to ``router_topk_kernel``) on any machine before spending GPU time.

    python scripts/inspect_router.py                                  # the H200 table's tiles
    python scripts/inspect_router.py --tiles '{"block_s": 64, "warps": 4}' --json out.json

Compiles ``router_topk_kernel`` for sm_90 (``--arch``) with the installed Triton (its bundled
``ptxas`` and ``nvdisasm``; no driver, no GPU; TRITON_INTERPRET must be unset) for the anchors
problem (Dh = 256, E = 256, top-6, sigmoid with a selection bias, bf16 x), and prints per tiles:
shared memory, registers, spilled bytes, the MMA the logits use (``mma.sync`` or ``wgmma``), how
many warps share one token's row of experts (every pick is a reduction across that many warps:
1 keeps it within a warp), and the barriers and warp shuffles in the SASS.

Why it exists (docs/PERFORMANCE.md, "Where the top-K launch's time goes"): at the committed 32
tokens and 8 warps the logits are laid over the warps along the experts, so each of the six
picks crosses all eight warps; 64 tokens and 4 warps put the warps along the tokens (wgmma)
but spill unless the scores leave the registers. These are the compiler's numbers, not timings,
and they differ between Triton versions (screen with the GPU's version).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("inspect_router.py compiles for a GPU: unset TRITON_INTERPRET (the interpreter "
             "replaces @triton.jit kernels, so there is nothing to compile)")

from inspect_kernel import ptxas_usage, sass_lines  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from magi_moe.kernels.router import router_topk_kernel  # noqa: E402
from magi_moe.kernels.tiles import RoutingTiles, gpu_routing_tiles  # noqa: E402

SIGNATURE = {  # pointers 16-byte aligned and sizes as a real launch specialises them
    "x_ptr": "*bf16", "gate_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32",
    "probs_ptr": "*fp32", "block_counts_ptr": "*i32", "num_tokens": "i32", "stride_x": "i32",
    "route_scale": "fp32",
}


def compile_router(tiles: RoutingTiles, *, heads: int = 3, head_dim: int = 256,
                   experts: int = 256, top_k: int = 6, arch: int = 90):
    """The compiled ``router_topk_kernel`` for these tiles on ``sm_<arch>``, with the constexprs
    :func:`magi_moe.kernels.router.launch_router` passes on a GPU."""
    consts = dict(NUM_HEADS=heads, HEAD_DIM=head_dim, NUM_EXPERTS=experts,
                  E_PAD=max(16, triton.next_power_of_2(experts)), TOP_K=top_k,
                  K_PAD=max(2, triton.next_power_of_2(top_k)), BLOCK_S=tiles.block_s,
                  BLOCK_D=tiles.block_d, SOFTMAX=False, ROUTE_NORM=True, HAS_BIAS=True,
                  DOT_PRECISION="ieee", SPLIT_GATE=True, UPCAST=False, TUPLE_PICKS=True)
    names = router_topk_kernel.arg_names
    missing = set(names) - set(SIGNATURE) - set(consts)
    if missing:
        raise SystemExit(f"router_topk_kernel has parameters this script does not know: "
                         f"{sorted(missing)}; update SIGNATURE / consts")
    signature = {n: SIGNATURE.get(n, "constexpr") for n in names}
    pointers = [i for i, n in enumerate(names) if SIGNATURE.get(n, "").startswith("*")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in pointers + [names.index("stride_x")]}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    return triton.compile(ASTSource(fn=router_topk_kernel, signature=signature,
                                    constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": tiles.warps})


def logits_layout(ttgir: str) -> dict:
    """The MMA layout of the logits: its kind and how its warps split tokens x experts."""
    found = re.search(r"#ttg\.nvidia_mma<\{versionMajor = (\d+),[^}]*warpsPerCTA = \[(\d+), "
                      r"(\d+)\]", ttgir)
    if not found:
        return {"mma": None, "warps_along_tokens": None, "warps_across_experts": None}
    major, rows, cols = (int(g) for g in found.groups())
    return {"mma": "wgmma" if major == 3 else "mma.sync", "warps_along_tokens": rows,
            "warps_across_experts": cols}


def inspect(tiles: RoutingTiles, arch: int = 90) -> dict:
    compiled = compile_router(tiles, arch=arch)
    lines, _ = sass_lines(compiled.asm["cubin"])
    opcodes = [ins.split()[0] if not ins.startswith("@") else ins.split()[1] for _, ins in lines]
    return {"tiles": {k: v for k, v in asdict(tiles).items() if k in ("block_s", "block_d",
                                                                       "warps")},
            "shared_bytes": compiled.metadata.shared,
            **ptxas_usage(compiled, arch),
            **logits_layout(compiled.asm["ttgir"]),
            "barriers": sum(op.startswith("BAR") for op in opcodes),
            "shuffles": sum(op.startswith("SHFL") for op in opcodes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", action="append", default=[],
                    help="RoutingTiles fields as JSON over the --device entry's (repeatable)")
    ap.add_argument("--device", default="H200", help="tile-table entry to read (default H200)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    base = gpu_routing_tiles(args.device)
    try:
        chosen = [replace(base, **json.loads(t)) for t in args.tiles] or [base]
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        ap.error(f"--tiles must be JSON RoutingTiles fields, e.g. '{{\"block_s\": 64}}': {exc}")
    results = [inspect(t, args.arch) for t in chosen]
    print(f"{'block_s':>7} {'block_d':>7} {'warps':>5} {'smem KiB':>9} {'regs':>5} {'spill B':>8} "
          f"{'mma':>8} {'warps/row':>9} {'BAR':>5} {'SHFL':>5}")
    for r in results:
        t = r["tiles"]
        print(f"{t['block_s']:>7} {t['block_d']:>7} {t['warps']:>5} "
              f"{r['shared_bytes'] / 1024:>9.1f} {r['registers'] or '-':>5} "
              f"{r['spilled_bytes'] if r['spilled_bytes'] is not None else '-':>8} "
              f"{r['mma'] or '-':>8} {r['warps_across_experts'] or '-':>9} {r['barriers']:>5} "
              f"{r['shuffles']:>5}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
