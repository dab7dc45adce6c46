"""How fast can the H200 stream weight tiles from L2 into its multiprocessors? A ceiling for the
fused one-kernel path, which at BM=64 re-reads every routed bank's weights once per row block
(docs/PERFORMANCE.md: about 3.1 GB from L2 in 0.54 ms at H=3, S=4096).

    python scripts/measure_l2.py [--json out.json]        # needs a CUDA GPU with TMA (Hopper+)

Each program streams whole "banks" (``[I=1280, Dh=256]`` bf16, 640 KiB, like one down weight)
tile by tile, as the kernel's down projection does: ``[16, 256]`` tiles by tensor descriptor
(TMA) or by pointer loads, pipelined over ``num_stages``, each consumed by one 64x256x16 MMA
(a 128-cycle instruction for 8 KiB: room for 15 TB/s over 132 multiprocessors, so the stream,
not the consumer, is what is measured; an MMA consumer is also what makes Triton pipeline
the loads).
Programs walk the banks round-robin over a working set small enough to stay in L2 (8 and
24 MiB) or far too big for it (1.5 GiB: memory bandwidth, for comparison). Timed with CUDA
events (magi_moe.bench.timing's timer, no flush) after a warm-up, median of 20; bandwidth =
bytes the programs read / time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from magi_moe.bench.timing import time_one  # noqa: E402

ROWS, COLS, BM = 1280, 256, 64  # a bank: [I, Dh] like one W_down; tiles [16, Dh]
TILE = 16


@triton.jit
def stream_kernel(src, out_ptr, num_banks, trips, ROWS: tl.constexpr, COLS: tl.constexpr,
                  TILE: tl.constexpr, BM: tl.constexpr, TMA: tl.constexpr):
    """``src``: a tensor descriptor (``TMA``) or the weight pointer."""
    pid = tl.program_id(0)
    a = (tl.arange(0, BM)[:, None] + tl.arange(0, TILE)[None, :]).to(tl.bfloat16)
    acc = tl.zeros((BM, COLS), dtype=tl.float32)
    r = tl.arange(0, TILE)[:, None]
    c = tl.arange(0, COLS)[None, :]
    for t in range(trips):
        bank = (pid + t * tl.num_programs(0)) % num_banks
        for j in range(ROWS // TILE):
            if TMA:
                tile = src.load([bank * ROWS + j * TILE, 0])
            else:
                tile = tl.load(src + (bank.to(tl.int64) * ROWS + j * TILE + r) * COLS + c)
            acc = tl.dot(a, tile, acc)
    offs = tl.arange(0, BM)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + pid * BM * COLS + offs, acc)


def measure(kind: str, working_set: int, programs: int, stages: int, iters: int = 20) -> dict:
    bank_bytes = ROWS * COLS * 2
    banks = max(1, working_set // bank_bytes)
    w = torch.randn(banks * ROWS, COLS, device="cuda").to(torch.bfloat16)
    out = torch.empty(programs, BM, COLS, device="cuda")
    trips = max(16, (64 * banks) // programs)  # long enough to hide launch and tail
    src = w
    if kind == "tma":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                     device="cuda"))
        src = TensorDescriptor.from_tensor(w, [TILE, COLS])

    def launch():
        stream_kernel[(programs,)](src, out, banks, trips, ROWS, COLS, TILE, BM, TMA=kind == "tma",
                                   num_warps=4, num_stages=stages)
    seconds = time_one(launch, warmup=3, iters=iters, flush_mib=0, device=w.device) / 1e3
    read = programs * trips * bank_bytes
    return dict(kind=kind, working_set_mib=banks * bank_bytes / 2**20, programs=programs,
                stages=stages, bytes_read=read, ms=seconds * 1e3, tb_per_s=read / seconds / 1e12)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("probe_l2.py needs a CUDA GPU with TMA (Hopper or later)", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for working_set in (8 << 20, 24 << 20, 1536 << 20):
        for kind in ("tma", "ptr"):
            for per_sm, stages in ((1, 3), (1, 5), (2, 3), (2, 5)):
                rows.append(measure(kind, working_set, sms * per_sm, stages))
                r = rows[-1]
                print(f"{r['kind']:>4} working set {r['working_set_mib']:7.1f} MiB  "
                      f"{per_sm} program(s)/SM  {stages} stages  {r['ms']:8.3f} ms  "
                      f"{r['tb_per_s']:5.2f} TB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
