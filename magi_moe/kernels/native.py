"""The native kernel: gather each expert's tokens, gate/up, SwiGLU7, down, weight, scatter.

One program handles up to ``BLOCK_M`` routes of one bank ``f = h*E + e`` (a block of the CSR
route table); experts with no routes get no program. Two variants share the kernel:

* atomic: every route adds ``p * expert(x)`` into an fp32 ``[S, H*Dh]`` accumulator with
  ``tl.atomic_add``; the add order varies between runs on a GPU, so the result does too.
* deterministic: every route stores ``p * expert(x)`` into its own fp32 row; a fixed-order
  sum over the top-k slots then reduces them. No atomics, so bitwise identical run after run.

Both round once, from fp32 to the output dtype, at the end. Offsets into ``x``, the weights
and the outputs are computed in int64 (CONTRACT section 7: ``token * row_stride`` passes 2^31
from token 699,051 at ``H*Dh = 3072``).

Interpreter traps (CONTRACT section 8) handled here: ``tl.dot`` on bf16 operands is wrong under
the interpreter, so ``UPCAST`` converts operands to fp32 first (bf16*bf16 products are exact
in fp32: only the summation order differs from the tensor cores); atomics are fp32 anyway; and
the interpreter's fp32->bf16 conversion truncates, so the activation is rounded by
``rounding.round_operand`` (see that module).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..backends import interpreter_enabled
from ..config import MoEConfig
from ..debug import workspace
from ..inputs import check_expert_inputs
from ..routing import RouteTable
from ..validation import check_kernel_device, check_tensor
from ..weights import ExpertWeights
from .device import shared_memory_limit
from .rounding import round_operand, swiglu7


@triton.jit
def native_expert_kernel(
    # pointers
    x_ptr,            # [S, H*Dh] input (bf16/fp16/fp32), row stride stride_x
    w_gate_ptr,       # [H*E, Dh, I] contiguous
    w_up_ptr,         # [H*E, Dh, I] contiguous
    w_down_ptr,       # [H*E, I, Dh] contiguous
    gather_ptr,       # [R] int32 token index per route (CSR order)
    probs_ptr,        # [R] fp32 routing weight per route
    offsets_ptr,      # [H*E + 1] int64 CSR offsets
    block_bank_ptr,   # [num_blocks] int64 bank of each program's block
    block_start_ptr,  # [num_blocks] int64 first route of each program's block
    out_ptr,          # atomic: fp32 [S, H*Dh] accumulator; deterministic: fp32 [R, Dh] rows
    # sizes and strides
    stride_x,
    stride_out,
    num_experts,
    HEAD_DIM: tl.constexpr,
    INTER: tl.constexpr,
    # tiles and modes
    DH_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no tf32), else the default
):
    pid = tl.program_id(0)
    bank = tl.load(block_bank_ptr + pid).to(tl.int64)
    start = tl.load(block_start_ptr + pid).to(tl.int64)
    end = tl.load(offsets_ptr + bank + 1).to(tl.int64)
    head = bank // num_experts

    rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
    row_mask = rows < end
    tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    probs = tl.load(probs_ptr + rows, mask=row_mask, other=0.0)

    d = tl.arange(0, DH_PAD)
    d_mask = d < HEAD_DIM
    x_tile = tl.load(
        x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        x_tile = x_tile.to(tl.float32)

    w_gate_bank = w_gate_ptr + bank * (HEAD_DIM * INTER)
    w_up_bank = w_up_ptr + bank * (HEAD_DIM * INTER)
    w_down_bank = w_down_ptr + bank * (INTER * HEAD_DIM)

    acc = tl.zeros((BLOCK_M, DH_PAD), dtype=tl.float32)
    for n0 in range(0, INTER, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < INTER
        gu_offsets = d[:, None] * INTER + n[None, :]
        gu_mask = d_mask[:, None] & n_mask[None, :]
        w_g = tl.load(w_gate_bank + gu_offsets, mask=gu_mask, other=0.0)
        w_u = tl.load(w_up_bank + gu_offsets, mask=gu_mask, other=0.0)
        if UPCAST:
            w_g = w_g.to(tl.float32)
            w_u = w_u.to(tl.float32)
        g = tl.dot(x_tile, w_g, input_precision=DOT_PRECISION)  # fp32 accumulation over Dh
        u = tl.dot(x_tile, w_u, input_precision=DOT_PRECISION)
        # SwiGLU7 in fp32, rounded once to the weights' dtype as the down-projection operand.
        a = round_operand(swiglu7(g, u), w_down_ptr.dtype.element_ty, UPCAST)
        w_d = tl.load(
            w_down_bank + n[:, None] * HEAD_DIM + d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            w_d = w_d.to(tl.float32)
        acc += tl.dot(a, w_d, input_precision=DOT_PRECISION)  # fp32 accumulation over I

    acc = acc * probs[:, None]  # routing weight in fp32
    out_mask = row_mask[:, None] & d_mask[None, :]
    if DETERMINISTIC:
        tl.store(out_ptr + rows[:, None] * stride_out + d[None, :], acc, mask=out_mask)
    else:
        tl.atomic_add(
            out_ptr + tokens[:, None] * stride_out + head * HEAD_DIM + d[None, :],
            acc,
            mask=out_mask,
        )


@dataclass(frozen=True)
class NativeTiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def shared_memory_estimate(tiles: NativeTiles, config: MoEConfig, itemsize: int) -> int:
    """Bytes of shared memory the kernel's tiles need, roughly as the compiler lays them out: the
    resident x block ``[BLOCK_M, DH_PAD]``, per pipeline stage the gate, up and down weight tiles
    (``DH_PAD x BLOCK_N`` each), and the activation tile."""
    dh_pad = max(16, triton.next_power_of_2(config.head_dim))
    per_stage = 3 * dh_pad * tiles.block_n
    return itemsize * (tiles.block_m * dh_pad + tiles.num_stages * per_stage
                       + tiles.block_m * tiles.block_n)


def fit_shared_memory(tiles: NativeTiles, config: MoEConfig, itemsize: int,
                      limit: int) -> NativeTiles:
    """``tiles`` shrunk until :func:`shared_memory_estimate` is within ``limit``: first the weight
    tiles' width, then the pipeline depth, then the row block (a wide head in fp32 needs all
    three; the fuzzers found Dh = 272 asking for 256 KiB on an H200)."""
    while shared_memory_estimate(tiles, config, itemsize) > limit:
        if tiles.block_n > 16:
            tiles = replace(tiles, block_n=tiles.block_n // 2)
        elif tiles.num_stages > 1:
            tiles = replace(tiles, num_stages=1)
        elif tiles.block_m > 16:
            tiles = replace(tiles, block_m=tiles.block_m // 2)
        else:
            raise ValueError(f"head_dim={config.head_dim} needs more shared memory than this GPU's "
                             f"{limit} bytes even at the smallest native tiles")
    return tiles


def choose_tiles(config: MoEConfig, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16) -> NativeTiles:
    """Tiles for this shape and device. The interpreter pays per program and per operation, so it
    gets small row blocks; the GPU gets 64-row blocks (Hopper) with the full head width resident,
    shrunk where a wide head would not fit the GPU's shared memory."""
    if device.type != "cuda":  # fewer, larger steps: the interpreter's cost is per operation
        return NativeTiles(block_m=16, block_n=128, num_warps=1, num_stages=1)
    wide = triton.next_power_of_2(config.head_dim) >= 256
    tiles = NativeTiles(block_m=64, block_n=32 if wide else 64, num_warps=8 if wide else 4,
                        num_stages=2)
    limit = shared_memory_limit(torch.device("cuda", device.index if device.index is not None
                                              else torch.cuda.current_device()))
    return fit_shared_memory(tiles, config, dtype.itemsize, limit)


def block_schedule(offsets: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One entry per nonempty ``block_m``-route block: (bank, first route). Synchronises once to
    size the grid; empty banks get no entry. Example, ``offsets = [0, 3, 3, 5]``, ``block_m = 2``:
    banks ``[0, 0, 2]``, starts ``[0, 2, 3]``."""
    counts = offsets[1:] - offsets[:-1]
    blocks_per_bank = (counts + block_m - 1) // block_m
    total = int(blocks_per_bank.sum())
    banks = torch.repeat_interleave(
        torch.arange(counts.numel(), device=offsets.device), blocks_per_bank, output_size=total
    )
    first_block = torch.cumsum(blocks_per_bank, 0) - blocks_per_bank
    index_in_bank = torch.arange(total, device=offsets.device) - first_block[banks]
    starts = offsets[:-1][banks] + index_in_bank * block_m
    return banks, starts


def check_native_inputs(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                        config: MoEConfig) -> None:
    check_expert_inputs(x, table, weights, config,
                        dtypes=(torch.bfloat16, torch.float16, torch.float32))
    check_kernel_device("x", x)
    if x.stride(-1) != 1:
        raise ValueError(f"x must have unit stride in its last dim, got strides {x.stride()}")
    for name, w in weights._asdict().items():
        if not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    check_tensor("table.sorted_probs", table.sorted_probs, dtype=torch.float32)


def launch_native(x, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
                  accumulator: torch.Tensor, *, deterministic: bool,
                  tiles: NativeTiles | None = None) -> None:
    """Run the kernel into a caller-owned fp32 ``accumulator``: ``[S, H*Dh]`` (zeroed) for the
    atomic variant, ``[R, Dh]`` for the deterministic one. Huge-input tests call this directly
    with lazily allocated buffers."""
    tiles = tiles or choose_tiles(config, x.device, x.dtype)
    banks, starts = block_schedule(table.offsets, tiles.block_m)
    if banks.numel() == 0:
        return
    interpret = interpreter_enabled()
    native_expert_kernel[(banks.numel(),)](
        x, weights.w_gate, weights.w_up, weights.w_down,
        table.gather_ids, table.sorted_probs, table.offsets, banks, starts,
        accumulator,
        x.stride(0), accumulator.stride(0), config.num_experts,
        HEAD_DIM=config.head_dim, INTER=config.intermediate_size,
        DH_PAD=max(16, triton.next_power_of_2(config.head_dim)),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        DETERMINISTIC=deterministic, UPCAST=interpret,
        DOT_PRECISION="ieee" if interpret or x.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def reduce_route_rows(rows: torch.Tensor, table: RouteTable, config: MoEConfig) -> torch.Tensor:
    """Sum per-route fp32 rows ``[R, Dh]`` into ``[S, H*Dh]`` in a fixed order (k = 0..K-1).

    Slots without a route (hand-built tables) read a zero row."""
    S, H, K, Dh = table.num_tokens, config.num_heads, config.top_k, config.head_dim
    R = table.num_routes
    padded = torch.cat([rows, rows.new_zeros(1, Dh)])
    slot_to_row = torch.full((S * H * K,), R, dtype=torch.int64, device=rows.device)
    slot_to_row[table.route_slots] = torch.arange(R, device=rows.device)
    per_slot = padded[slot_to_row].view(S, H, K, Dh)
    total = per_slot[:, :, 0]
    for k in range(1, K):  # explicit order: no reduction-order freedom left to the backend
        total = total + per_slot[:, :, k]
    return total.reshape(S, H * Dh)


def native_forward(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
                   *, deterministic: bool = False, out: torch.Tensor | None = None,
                   tiles: NativeTiles | None = None) -> torch.Tensor:
    """The expert computation with the native kernel; returns ``[S, H*Dh]`` in ``x.dtype``."""
    check_native_inputs(x, table, weights, config)
    S, D = x.shape
    if out is None:
        out = torch.empty(S, D, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, shape=(S, D), dtype=x.dtype, device=x.device)
    if deterministic:
        rows = workspace(table.num_routes, config.head_dim, dtype=torch.float32, device=x.device)
        launch_native(x, table, weights, config, rows, deterministic=True, tiles=tiles)
        out.copy_(reduce_route_rows(rows, table, config))
    else:
        acc = torch.zeros(S, D, dtype=torch.float32, device=x.device)
        launch_native(x, table, weights, config, acc, deterministic=False, tiles=tiles)
        out.copy_(acc)
    return out
