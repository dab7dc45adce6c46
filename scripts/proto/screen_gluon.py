"""Compile a Gluon prototype of scripts/proto/gluon_mlp.py for sm_90 without a GPU and report what
ptxas made of it: shared memory, registers, spilled bytes, the innermost MMA loop (as
scripts/inspect_kernel.py counts it) and the kernel's wgmma waits (``WARPGROUP.DEPBAR``). A
DEPBAR after every HGMMA means ptxas serialised the MMAs for want of registers (seen here with
x in registers at BLOCK_N 32); the pipelined kernel must keep its ``DEPBAR.LE gsb0, 0x1``.

    python scripts/proto/screen_gluon.py expert_mlp_gluon_t2_kernel \\
        '{"block_m": 128, "block_n": 64, "warps": 8, "GU_SLOTS": 4}'

Needs Triton 3.6 (the H200's; its Gluon API) and TRITON_INTERPRET unset.
"""
import inspect
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

import gluon_mlp  # noqa: E402
import gluon_sd  # noqa: E402
import gluon_ws  # noqa: E402
import inspect_kernel as IK  # noqa: E402


def placeholder_args(block_n, gate_rows, head_dim=256, inter=1280, banks=768, down_cols=None):
    """Arguments typed like ab_gluon.py's launch (small CPU tensors: dtypes, descriptor block
    shapes and divisibility are what the compiler sees)."""
    bf16 = torch.bfloat16

    def desc(rows, cols, block):
        t = torch.empty(rows, cols, dtype=bf16)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
    i32, i64, f32 = (torch.empty(16, dtype=d) for d in (torch.int32, torch.int64, torch.float32))
    x = torch.empty(4096, 3 * head_dim, dtype=bf16)
    return [x, desc(banks * head_dim, inter, [gate_rows, block_n]),
            desc(banks * head_dim, inter, [gate_rows, block_n]),
            desc(banks * inter, head_dim, [block_n, down_cols or head_dim]),
            i32, f32, i64, i64, i32, i64, i32, f32, i32, x.stride(0), head_dim, 256]


def compile_prototype(kernel, block_m, block_n, warps, **constexprs):
    transposed = "GU_SLOTS" in constexprs  # half-Dh gate/up units
    names = kernel.arg_names
    signature, attrs = {}, {}
    # the split-D kernel loads W_down in [BLOCK_N, Dh/2] boxes
    args = placeholder_args(block_n, 128 if transposed else 256,
                            down_cols=128 if "SPLIT_D" in constexprs else None)
    if "pair_first_ptr" in names:  # the warp-specialised kernel's pair schedule
        args += [torch.empty(16, dtype=torch.int32) for _ in range(3)]
    for i, arg in enumerate(args):
        kind, key = native_specialize_impl(BaseBackend, arg, False, True, True)
        signature[names[i]] = kind
        if isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    defaults = {p.name: p.default for p in kernel.params
                if p.is_constexpr and p.default is not inspect.Parameter.empty}
    consts = dict(defaults, HEAD_DIM=256, INTER=1280, BLOCK_M=block_m, BLOCK_N=block_n,
                  num_warps=warps, **constexprs)
    for name in consts:
        signature[name] = "constexpr"
    source = GluonASTSource(fn=kernel, signature=signature, attrs=attrs,
                            constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def report(compiled) -> dict:
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([IK.get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o",
                               str(Path(d) / "kernel.o")], capture_output=True, text=True).stderr
    lines, labels = IK.sass_lines(compiled.asm["cubin"])
    waits = Counter(i.strip() for _, i in lines if i.startswith("WARPGROUP.DEPBAR"))
    registers = re.search(r"Used (\d+) registers", info)
    spilled = re.search(r"(\d+) bytes spill stores", info)
    return {"shared_bytes": compiled.metadata.shared,
            "registers": int(registers.group(1)) if registers else None,
            "spilled_bytes": int(spilled.group(1)) if spilled else None,
            "inner_loop": IK.innermost_mma_loop(lines, labels), "wgmma_waits": dict(waits)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        sys.exit(__doc__)
    module = gluon_ws if "_ws" in argv[0] else gluon_sd if "_sd" in argv[0] else gluon_mlp
    kernel = getattr(module, argv[0])
    for spec in argv[1:]:
        fields = json.loads(spec)
        shape = [fields.pop(k) for k in ("block_m", "block_n", "warps")]
        print(spec, json.dumps(report(compile_prototype(kernel, *shape, **fields))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
