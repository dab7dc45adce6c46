"""Broken outside implementations, written the way a kernel team's adapter would be, each with a
bug of a class magi-moe must catch through its own strategies (tests/test_outside_broken_kernels.py):

* :data:`INT32_WRAP`: accepts only ``Dh % 64 == 0`` and ``I % 32 == 0`` (declared in its
  ``ShapeRule``) and computes the row offset ``token * row_stride`` in signed int32, emulated in
  torch. Right at every shape below ``2^31 / (H*Dh)`` tokens; past it, the offset wraps and the
  kernel reads and writes other rows (vLLM-Omni #5918, SGLang #4727). At the fuzzers' small
  widths it is never asked at all: only strategies that draw inside its shape rule reach it.
* :data:`WANDERING_SUM`: declares ``deterministic`` but adds the top-k routes of a token in an
  order that changes from call to call (a work queue, a split-K that depends on timing); fp32
  reassociation then changes a few bf16 outputs between runs.

Neither is registered; tests name them ``magi_moe.tests.outside_broken_kernels:ATTR``.
"""
from __future__ import annotations

import itertools

import torch

from magi_moe.implementation import Implementation, ShapeRule


def _route_rows(x, table, weights, config, offsets: torch.Tensor) -> torch.Tensor:
    """Each route's expert output times its probability, fp32 ``[R, Dh]``, reading the token's
    row at element ``offsets[r]`` of the flat input (the caller's offset arithmetic)."""
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    bank = torch.repeat_interleave(torch.arange(H * E, device=x.device), table.counts())
    cols = (bank // E * Dh)[:, None] + torch.arange(Dh, device=x.device)
    rows = x.reshape(-1)[offsets[:, None] + cols].float()
    g = torch.einsum("rd,rdi->ri", rows, weights.w_gate[bank].float()).clamp(max=7.0)
    u = torch.einsum("rd,rdi->ri", rows, weights.w_up[bank].float()).clamp(-7.0, 7.0)
    act = (g * torch.sigmoid(1.702 * g) * (u + 1)).to(x.dtype).float()
    down = torch.einsum("ri,rid->rd", act, weights.w_down[bank].float())
    return down * table.sorted_probs[:, None].float(), bank


def _sum_topk(contrib, table, config, order) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 sum of each routed (token, head) pair's routes, adding rank ``order[0]`` first."""
    K = config.top_k
    pair, rank = table.route_slots // K, table.route_slots % K
    pairs, index = torch.unique(pair, return_inverse=True)
    acc = torch.zeros(pairs.numel(), contrib.shape[1], dtype=torch.float32, device=contrib.device)
    for k in order:
        chosen = rank == k
        acc[index[chosen]] += contrib[chosen]
    return pairs, acc


def _int32_wrap_forward(x, table, weights, config, *, out):
    if config.head_dim % 64 or config.intermediate_size % 32:
        raise ValueError(f"this kernel needs head_dim % 64 == 0 and intermediate_size % 32 == 0, "
                         f"got {config.head_dim}, {config.intermediate_size}")
    H, Dh, stride = config.num_heads, config.head_dim, config.hidden_size
    # the bug: token * row_stride in int32 (torch's int32 product wraps like the GPU's)
    wrapped = table.gather_ids.to(torch.int32) * torch.tensor(stride, dtype=torch.int32)
    contrib, _ = _route_rows(x, table, weights, config, wrapped.long())
    pairs, acc = _sum_topk(contrib, table, config, range(config.top_k))
    out.zero_()
    token = (pairs // H).to(torch.int32)
    out_rows = (token * torch.tensor(stride, dtype=torch.int32)).long() + (pairs % H) * Dh
    out.view(-1)[out_rows[:, None] + torch.arange(Dh, device=x.device)] = acc.to(out.dtype)
    return out


INT32_WRAP = Implementation(
    name="outside-int32-wrap", forward=_int32_wrap_forward, backends=("cpu", "cuda"),
    precision="bf16-fp32acc", dtypes=(torch.bfloat16,),
    capabilities={"deterministic", "int64_offsets"},  # claims int64 offsets, wrongly
    shapes=ShapeRule(head_dim_multiple=64, intermediate_multiple=32),
    description="BROKEN on purpose: wide heads only, token * row_stride wraps to signed int32")

_calls = itertools.count()


def _wandering_forward(x, table, weights, config, *, out):
    K = config.top_k
    start = next(_calls) % K  # the order of the top-k sum changes from call to call
    offsets = table.gather_ids.long() * config.hidden_size
    contrib, _ = _route_rows(x, table, weights, config, offsets)
    pairs, acc = _sum_topk(contrib, table, config, [(start + k) % K for k in range(K)])
    out.zero_()
    H, Dh = config.num_heads, config.head_dim
    out.unflatten(1, (H, Dh))[pairs // H, pairs % H] = acc.to(out.dtype)
    return out


WANDERING_SUM = Implementation(
    name="outside-wandering-sum", forward=_wandering_forward, backends=("cpu", "cuda"),
    precision="bf16-fp32acc", dtypes=(torch.bfloat16,),
    capabilities={"deterministic", "int64_offsets"},  # claims determinism, wrongly
    description="BROKEN on purpose: the top-k sum's order changes from call to call")
