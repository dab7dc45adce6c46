"""What the compiler made of the fused one-kernel path, without a GPU: screen tiles (or a kernel
change) on any machine before spending GPU time.

    python scripts/inspect_kernel.py                      # every class of the H200 table
    python scripts/inspect_kernel.py --tiles '{"block_m": 64, "gu_block_n": 32, "gu_warps": 8}'
    python scripts/inspect_kernel.py --json out.json

Compiles ``expert_mlp_tma_kernel`` for sm_90 (``--arch``) with the installed Triton (its bundled
``ptxas`` and ``nvdisasm``; no driver, no GPU; TRITON_INTERPRET must be unset), specialised as
a real launch would be (pointer and stride divisibility by 16), and prints per tiles: shared
memory, registers per thread, spilled bytes, and the innermost loop that issues Hopper MMAs
(HGMMA): its instructions and HGMMAs per trip, how many of those take their first operand from
registers ("reg A"; the rest read both from shared memory), and its local-memory spills.

Why it exists (docs/PERFORMANCE.md, "The one-kernel loop"): three kernel shapes were written, passed their
bitwise tests on the H200 and were 1.1-4x slower; here, on Triton 3.6, each shows it at once.
The plain kernel's loop over ``I`` is 502 instructions and 34 HGMMAs a trip at BM=128 (334 and
33 at BM=64), with no spills. The two-halves block's loop is 1,979 instructions, 132 HGMMAs
and 118 spill accesses a trip; the transposed 64/32 form falls back to 8 HGMMAs and 171 spill
accesses; the mixed form's big-block loop grew to 558 instructions, the 11% it lost at
S=16384. These are the compiler's numbers, not timings: a clean loop is necessary, not
sufficient, and they differ between Triton versions (screen with the GPU's version).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default, the GPU's version
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("inspect_kernel.py compiles for a GPU: unset TRITON_INTERPRET (the interpreter "
             "replaces @triton.jit kernels, so there is nothing to compile)")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from magi_moe.kernels import expert_mlp  # noqa: E402
from magi_moe.kernels.tiles import FusedTiles, load_tile_table  # noqa: E402
from magi_moe.config import preset  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def placeholder_args(tiles: FusedTiles, head_dim: int, inter: int, heads: int, experts: int,
                     tokens: int) -> list:
    """Arguments shaped and typed like a real launch (small CPU tensors: only dtypes, the
    descriptors' block shapes and the divisibility of pointers and strides matter here)."""
    bf16, banks = torch.bfloat16, heads * experts
    w_gate = torch.empty(banks * head_dim, inter, dtype=bf16)
    w_down = torch.empty(banks * inter, head_dim, dtype=bf16)
    gate_desc = TensorDescriptor.from_tensor(w_gate, [head_dim, tiles.gu_block_n])
    down_desc = TensorDescriptor.from_tensor(w_down, [tiles.gu_block_n, head_dim])
    i32, i64 = torch.empty(16, dtype=torch.int32), torch.empty(16, dtype=torch.int64)
    f32 = torch.empty(16, dtype=torch.float32)
    x = torch.empty(tokens, heads * head_dim, dtype=bf16)
    # x, wg, wu, wd, gather, probs, slots, offsets, block_bank, block_start, block_count, rows,
    # slot_route, stride_x, stride_rows, num_experts: as expert_mlp._launch passes them
    return [x, gate_desc, gate_desc, down_desc, i32, f32, i64, i64, i32, i64, i32, f32, i32,
            x.stride(0), head_dim, experts]


def compile_one_kernel(tiles: FusedTiles, *, head_dim: int = 256, inter: int = 1280,
                       heads: int = 3, experts: int = 256, arch: int = 90, kernel=None,
                       extra_constexprs: dict | None = None):
    """The compiled ``expert_mlp_tma_kernel`` for these tiles on ``sm_<arch>``; ``kernel`` and
    ``extra_constexprs``: a changed copy of it (same parameters, more constexprs) to screen."""
    kernel = kernel or expert_mlp.expert_mlp_tma_kernel
    target = GPUTarget("cuda", arch, 32)
    names = kernel.arg_names
    signature, attrs = {}, {}
    for i, arg in enumerate(placeholder_args(tiles, head_dim, inter, heads, experts, 4096)):
        kind, key = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[names[i]] = kind
        if isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    consts = dict(HEAD_DIM=head_dim, INTER=inter, BLOCK_M=tiles.block_m, BLOCK_N=tiles.gu_block_n,
                  ACT_DTYPE=tl.bfloat16, UPCAST=False, DOT_PRECISION="tf32",
                  **(extra_constexprs or {}))
    missing = set(names[len(signature):]) - set(consts)
    if missing:
        raise SystemExit(f"expert_mlp_tma_kernel has parameters this script does not know: "
                         f"{sorted(missing)}; update placeholder_args / consts")
    for name in consts:
        signature[name] = "constexpr"
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    options = dict(num_warps=tiles.gu_warps, num_stages=tiles.gu_stages)
    if tiles.gu_maxnreg:
        options["maxnreg"] = tiles.gu_maxnreg
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                    attrs=attrs), target=target, options=options)


def _tool(name: str, *args: str) -> str:
    return subprocess.run([str(TOOLS / name), *args], capture_output=True, text=True,
                          check=True).stdout


def sass_lines(cubin: bytes) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, instruction) of the cubin's SASS, and each branch label's address."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        text = _tool("nvdisasm", "-hex", str(path))
    lines, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
        if ins:
            address = int(ins.group(1), 16)
            labels.update((p, address) for p in pending)
            pending = []
            lines.append((address, ins.group(2)))
    return lines, labels


def innermost_mma_loop(lines: list[tuple[int, str]], labels: dict[str, int]) -> dict | None:
    """The shortest loop (a branch back to an earlier label) that issues HGMMAs: the pipelined
    loop over ``I`` in a kernel that compiled well."""
    best = None
    for address, ins in lines:
        branch = re.search(r"BRA\s.*?(\.L_x_\d+)", ins)
        if not branch or labels.get(branch.group(1), address) >= address:
            continue
        start = labels[branch.group(1)]
        body = [i for a, i in lines if start <= a <= address]
        hgmma = sum(i.split()[0].lstrip("@!P0123456789T ").startswith("HGMMA") or " HGMMA" in i
                    for i in body)
        if hgmma and (best is None or len(body) < best["instructions"]):
            best = {"instructions": len(body), "hgmma": hgmma,
                    # "HGMMA.64x16x16.F32.BF16 R160, R156, gdesc[..]": the first operand from
                    # registers; "R160, gdesc[..]": both operands from shared memory
                    "hgmma_register_a": sum(bool(re.search(r"HGMMA\S* R\d+, R\d+, gdesc", i))
                                            for i in body),
                    "spill_stores": sum("STL" in i for i in body),
                    "spill_loads": sum("LDL" in i for i in body)}
    return best


def ptxas_usage(compiled, arch: int) -> dict:
    """Registers a thread and spilled bytes of a compiled kernel, as ``ptxas -v`` reports them."""
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        # the ptxas Triton itself assembles this arch with (newer Tritons emit PTX the
        # legacy one refuses)
        info = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", str(ptx),
                               "-o", str(Path(d) / "kernel.o")], capture_output=True, text=True)
    registers = re.search(r"Used (\d+) registers", info.stderr)
    spilled = re.search(r"(\d+) bytes spill stores", info.stderr)
    return {"registers": int(registers.group(1)) if registers else None,
            "spilled_bytes": int(spilled.group(1)) if spilled else None}


def inspect(tiles: FusedTiles, **shape) -> dict:
    """Shared memory, registers, spills and the innermost MMA loop of the compiled kernel
    (``shape``: :func:`compile_one_kernel`'s keywords)."""
    compiled = compile_one_kernel(tiles, **shape)
    lines, labels = sass_lines(compiled.asm["cubin"])
    return {"tiles": {k: v for k, v in asdict(tiles).items() if k.startswith(("gu_", "block_m"))},
            "shared_bytes": compiled.metadata.shared,
            **ptxas_usage(compiled, shape.get("arch", 90)),
            "inner_loop": innermost_mma_loop(lines, labels)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", action="append", default=[],
                    help="FusedTiles fields as JSON over the one-kernel defaults (repeatable); "
                         "default: every class of the --device entry of the tile table")
    ap.add_argument("--device", default="H200", help="tile-table entry to read (default H200)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90)")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--inter", type=int, default=1280)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    base = FusedTiles(gu_variant="mlp_tma", gu_block_k=args.head_dim)
    if args.tiles:
        try:
            chosen = [replace(base, **json.loads(t)) for t in args.tiles]
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            ap.error(f"--tiles must be JSON FusedTiles fields, e.g. '{{\"block_m\": 64}}': {exc}")
    else:
        chosen = [t for _, t in (load_tile_table(args.device) or [])]
        if not chosen:
            ap.error(f"the tile table has no entry matching {args.device!r}; pass --tiles")
    cfg = preset("magi2-full").replace(head_dim=args.head_dim, intermediate_size=args.inter)
    results = [inspect(t.fitted(cfg), head_dim=args.head_dim, inter=args.inter, arch=args.arch)
               for t in chosen]
    print(f"{'block_m':>7} {'bn':>4} {'warps':>5} {'stages':>6} {'smem KiB':>9} {'regs':>5} "
          f"{'spill B':>8} {'loop instr':>10} {'HGMMA':>6} {'reg A':>6} {'loop STL/LDL':>12}")
    for r in results:
        t, loop = r["tiles"], r["inner_loop"] or {}
        print(f"{t['block_m']:>7} {t['gu_block_n']:>4} {t['gu_warps']:>5} {t['gu_stages']:>6} "
              f"{r['shared_bytes'] / 1024:>9.1f} {r['registers'] or '-':>5} "
              f"{r['spilled_bytes'] if r['spilled_bytes'] is not None else '-':>8} "
              f"{loop.get('instructions', '-'):>10} {loop.get('hgmma', '-'):>6} "
              f"{loop.get('hgmma_register_a', '-'):>6} "
              f"{str(loop.get('spill_stores', '-')) + '/' + str(loop.get('spill_loads', '-')):>12}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
