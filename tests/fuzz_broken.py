"""Deliberately broken variants: each one reproduces a failure class of CONTRACT section 7, and the
tests show that the fuzzer built for it catches it within the CI budget.

* ``int32_offsets`` / :func:`launch_native_int32`: the native kernel with ``token * row_stride``
  in int32 (vLLM-Omni #5918, SGLang #4727). Correct at every small shape; past token
  ``2^31 / (H*Dh)`` it reads a wild address (SIGSEGV under the interpreter).
* :func:`route_ties_to_higher_index`: a router whose ties go to the *higher* expert index (as an
  ``if score >= best`` scan does), the cross-device top-k tie problem of PyTorch #127196.
* :func:`table_counts_unpicked_nan`: a router whose choices are right but whose own route table
  counts an unpicked NaN expert once per token (a fault the fused router once had: a NaN key
  equal to the "taken" sentinel), in plain torch.
* ``empty_expert_garbage``: a padded-block path whose block for an expert with no routes is not
  masked: it reads the neighbouring route's token and probability and adds the empty expert's
  output there (MSLK #158, SGLang #25137).
* :class:`VersionKeyedCache`: a packed-weight cache keyed on ``(id, data_ptr, _version)``, which
  serves stale weights after ``param.data.copy_(...)`` (CONTRACT 5; vLLM #42821, SGLang #14158).
  :class:`SnapshotCache` is the correct toy cache the same machine must pass.

One cheap CPU variant more for each remaining property, so that every property record has a
bug it is shown to catch (tests/test_fuzz_broken.py):

* ``drops_last_token`` (differential): a token loop that stops one short; the last row stays 0.
* ``writes_one_row_late`` (token_permutation): an off-by-one output row index.
* ``reads_next_head`` (head_locality): a head offset off by one head: each head reads its
  neighbour's slice of ``x``.
* ``weight_applied_twice`` (linearity): the routing weight applied before the activation and
  again at the sum, so the output goes with ``p^2``.
* ``no_routes_leaves_output_unwritten`` (zero_tokens): an early return when no route is left,
  before the output is zeroed.

``segfault_from_three_tokens`` is no bug class of its own: it kills its process, to show that a
campaign records such a case and goes on.

These are *not* registered: tests import them directly (registering would put them in every
test's implementation matrix); campaigns name them as ``magi_moe.tests.fuzz_broken:<attr>``.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

__all__ = ["CachedToyLayer", "SnapshotCache", "VersionKeyedCache", "drops_last_token",
           "empty_expert_garbage", "int32_offsets", "launch_native_int32", "no_routes_leaves_output_unwritten",
           "reads_next_head", "route_ties_to_higher_index", "segfault_from_three_tokens",
           "table_counts_unpicked_nan",
           "snapshot_cache_layer", "stale_cache_layer", "weight_applied_twice", "writes_one_row_late"]
from magi_moe.backends import interpreter_enabled
from magi_moe.config import MoEConfig
from magi_moe.kernels.native import block_schedule, choose_tiles
from magi_moe.kernels.rounding import round_operand
from magi_moe.layer import MagiMoE
from magi_moe.reference import expert_reference, swiglu7
from magi_moe.implementation import Implementation, RowLauncher
from magi_moe.routing import (Routes, build_route_table, route, route_probs, router_logits,
                              scores_from_logits)
from magi_moe.weights import ExpertWeights
from magi_moe.kernels.router_choices import TabledRoutes


# -- int32 offsets ----------------------------------------------------------------------------------
@triton.jit
def _int32_offsets_kernel(
    x_ptr, w_gate_ptr, w_up_ptr, w_down_ptr,   # as native_expert_kernel
    gather_ptr, probs_ptr, offsets_ptr, block_bank_ptr, block_start_ptr, out_ptr,
    stride_x, stride_out, num_experts,
    HEAD_DIM: tl.constexpr, INTER: tl.constexpr, DH_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DETERMINISTIC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    bank = tl.load(block_bank_ptr + pid).to(tl.int32)
    start = tl.load(block_start_ptr + pid).to(tl.int32)
    end = tl.load(offsets_ptr + bank + 1).to(tl.int32)
    head = bank // num_experts
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0)  # int32 ...
    d = tl.arange(0, DH_PAD)
    d_mask = d < HEAD_DIM
    # BUG (on purpose): tokens * stride_x is an int32 product and wraps past 2^31.
    x_tile = tl.load(x_ptr + tokens[:, None] * stride_x + head * HEAD_DIM + d[None, :],
                     mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        x_tile = x_tile.to(tl.float32)
    acc = tl.zeros((BLOCK_M, DH_PAD), dtype=tl.float32)
    for n0 in range(0, INTER, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < INTER
        gu = bank * (HEAD_DIM * INTER) + d[:, None] * INTER + n[None, :]
        gu_mask = d_mask[:, None] & n_mask[None, :]
        w_g = tl.load(w_gate_ptr + gu, mask=gu_mask, other=0.0)
        w_u = tl.load(w_up_ptr + gu, mask=gu_mask, other=0.0)
        if UPCAST:
            w_g = w_g.to(tl.float32)
            w_u = w_u.to(tl.float32)
        g = tl.minimum(tl.dot(x_tile, w_g, input_precision="ieee"), 7.0)
        u = tl.minimum(tl.maximum(tl.dot(x_tile, w_u, input_precision="ieee"), -7.0), 7.0)
        # rounded once, to nearest even under the interpreter too (its own cast truncates)
        a = round_operand(g * tl.sigmoid(1.702 * g) * (u + 1.0), w_down_ptr.dtype.element_ty, UPCAST)
        w_d = tl.load(w_down_ptr + bank * (INTER * HEAD_DIM) + n[:, None] * HEAD_DIM + d[None, :],
                      mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            w_d = w_d.to(tl.float32)
        acc += tl.dot(a, w_d, input_precision="ieee")
    acc = acc * tl.load(probs_ptr + rows, mask=row_mask, other=0.0)[:, None]
    mask = row_mask[:, None] & d_mask[None, :]
    if DETERMINISTIC:
        tl.store(out_ptr + rows[:, None] * stride_out + d[None, :], acc, mask=mask)
    else:
        tl.atomic_add(out_ptr + tokens[:, None] * stride_out + head * HEAD_DIM + d[None, :], acc, mask=mask)


def launch_native_int32(x, table, weights: ExpertWeights, config: MoEConfig, accumulator, *,
                        deterministic: bool, tiles=None) -> None:
    """``launch_native``'s contract, with int32 row offsets (the bug)."""
    tiles = tiles or choose_tiles(config, x.device, x.dtype)
    banks, starts = block_schedule(table.offsets, tiles.block_m)
    if banks.numel() == 0:
        return
    _int32_offsets_kernel[(banks.numel(),)](
        x, weights.w_gate, weights.w_up, weights.w_down, table.gather_ids, table.sorted_probs,
        table.offsets, banks, starts, accumulator, x.stride(0), accumulator.stride(0),
        config.num_experts, HEAD_DIM=config.head_dim, INTER=config.intermediate_size,
        DH_PAD=max(16, triton.next_power_of_2(config.head_dim)), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, DETERMINISTIC=deterministic, UPCAST=interpreter_enabled(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _int32_forward(x, table, weights, config, *, out):
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    launch_native_int32(x, table, weights, config, acc, deterministic=False)
    return out.copy_(acc)


int32_offsets = Implementation(
    "broken-int32-offsets", _int32_forward, ("interpret", "cuda"), "bf16-fp32acc",
    capabilities={"int64_offsets"},  # claims it, wrongly: the huge fuzzer must catch the lie
    launcher=RowLauncher("magi_moe.tests.fuzz_broken:launch_native_int32", "accumulate"),
    description="BROKEN on purpose: the native kernel with int32 token * row_stride")


# -- wrong tie order --------------------------------------------------------------------------------
def route_ties_to_higher_index(x, gate, bias, config: MoEConfig, *, dtype=torch.float32) -> Routes:
    """``magi_moe.routing.route`` except that among equal selection scores the higher index wins."""
    H, E = config.num_heads, config.num_experts
    scores = scores_from_logits(router_logits(x, gate, config, dtype), config.score_func)
    selection = scores if bias is None else scores + bias.reshape(H, E).to(dtype)
    key = torch.nan_to_num(selection.flip(-1), nan=float("-inf"))
    flipped = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :config.top_k]
    ids = (E - 1) - flipped  # BUG (on purpose): scanning from the top index keeps the last tie
    return Routes(expert_ids=ids, probs=route_probs(scores, ids, config))


# -- right choices, wrong table --------------------------------------------------------------------
def table_counts_unpicked_nan(x, gate, bias, config: MoEConfig) -> TabledRoutes:
    """``magi_moe.routing.route``'s choices, and their table with one phantom route per token in
    the first bank whose selection bias is NaN (unpicked: NaN ranks last)."""
    routes = route(x, gate, bias, config)
    table = build_route_table(routes, config)
    if bias is not None and bool(torch.isnan(bias).any()):
        bank = int(torch.isnan(bias).nonzero()[0, 0])
        offsets = table.offsets.clone()
        offsets[bank + 1:] += x.shape[0]  # BUG (on purpose): counted, never placed
        table = dataclasses.replace(table, offsets=offsets)
    return TabledRoutes(routes.expert_ids, routes.probs, table)


# -- an empty expert's block writes garbage -----------------------------------------------------------
def _empty_expert_garbage(x, table, weights, config, *, out):
    out.copy_(expert_reference(x, table, weights, config, precision="bf16"))
    if table.num_routes == 0:
        return out
    E, Dh = config.num_experts, config.head_dim
    counts, offsets = table.counts().tolist(), table.offsets.tolist()
    for f, count in enumerate(counts):
        if count:
            continue
        # BUG (on purpose): the padded block of an empty expert is not masked; it reads the
        # neighbouring route's token and weight and adds this expert's output there.
        r = min(offsets[f], table.num_routes - 1)
        token, h = int(table.gather_ids[r]), f // E
        xs = x[token, h * Dh:(h + 1) * Dh].float()
        g = xs @ weights.w_gate[f].float()
        u = xs @ weights.w_up[f].float()
        garbage = (swiglu7(g, u) @ weights.w_down[f].float()) * table.sorted_probs[r]
        out[token, h * Dh:(h + 1) * Dh] += garbage.to(out.dtype)
    return out


empty_expert_garbage = Implementation(
    "broken-empty-expert", _empty_expert_garbage, ("cpu",), "bf16-plain",
    description="BROKEN on purpose: an empty expert's block adds its output to a neighbour's row")


# -- one bug per remaining property ------------------------------------------------------------------
def _plain(x, table, weights, config):
    return expert_reference(x, table, weights, config, precision="bf16")


def _drops_last_token(x, table, weights, config, *, out):
    out.copy_(_plain(x, table, weights, config))
    if out.shape[0]:
        out[-1] = 0  # BUG (on purpose): the loop over tokens stops at S - 1
    return out


def _writes_one_row_late(x, table, weights, config, *, out):
    # BUG (on purpose): token s's row is stored at s + 1 (the last one wraps to row 0)
    return out.copy_(_plain(x, table, weights, config).roll(1, dims=0))


def _reads_next_head(x, table, weights, config, *, out):
    # BUG (on purpose): the head offset is one head too far: head h reads head h + 1's slice
    return out.copy_(_plain(x.roll(-config.head_dim, dims=1), table, weights, config))


def _weight_applied_twice(x, table, weights, config, *, out):
    # BUG (on purpose): the routing weight scales the activation and the sum again: p^2
    squared = dataclasses.replace(table, sorted_probs=table.sorted_probs * table.sorted_probs)
    return out.copy_(_plain(x, squared, weights, config))


def _no_routes_leaves_output_unwritten(x, table, weights, config, *, out):
    if table.num_routes == 0:
        return out  # BUG (on purpose): nothing to launch, and the output is never zeroed
    return out.copy_(_plain(x, table, weights, config))


def _broken(name: str, forward, what: str) -> Implementation:
    return Implementation(name, forward, ("cpu",), "bf16-plain", description=f"BROKEN on purpose: {what}")


drops_last_token = _broken("broken-drops-last-token", _drops_last_token,
                           "the last token's row is never computed")
writes_one_row_late = _broken("broken-one-row-late", _writes_one_row_late,
                              "each token's row is written one row late")
reads_next_head = _broken("broken-next-head", _reads_next_head, "each head reads the next head's input")
weight_applied_twice = _broken("broken-weight-twice", _weight_applied_twice,
                               "the routing weight is applied twice")
no_routes_leaves_output_unwritten = _broken("broken-no-routes-unwritten", _no_routes_leaves_output_unwritten,
                                            "with no route left the output is never written")


# -- weight caches ------------------------------------------------------------------------------------
PACKED = ("W_gate", "W_up", "W_down")


def _pack(layer: MagiMoE) -> ExpertWeights:
    """The toy "pack": gate and up fused into one ``[H*E, Dh, 2I]`` bank (as the fused path
    does), then viewed back; copies, so a stale pack really holds the old values."""
    I = layer.config.intermediate_size
    gate_up = torch.cat([layer.W_gate.detach(), layer.W_up.detach()], dim=-1).clone()
    return ExpertWeights(gate_up[..., :I].contiguous(), gate_up[..., I:].contiguous(),
                         layer.W_down.detach().clone())


class _ToyCache:
    """Packs on first use and whenever ``is_current`` says the layer's weights moved on."""

    def __init__(self):
        self.pack_count = 0
        self._packed: ExpertWeights | None = None

    def invalidate(self) -> None:
        self._packed = None

    def weights(self, layer: MagiMoE) -> ExpertWeights:
        if self._packed is None or not self.is_current(layer):
            self._packed = _pack(layer)
            self.remember(layer)
            self.pack_count += 1
        return self._packed


class VersionKeyedCache(_ToyCache):
    """BROKEN on purpose: ``(id, data_ptr, _version)`` misses ``param.data.copy_`` (CONTRACT 5)."""

    @staticmethod
    def _key(layer):
        def version(p):
            try:
                return p._version
            except RuntimeError:  # inference tensors have no version counter
                return -1
        return tuple((id(p), p.data_ptr(), version(p)) for p in (getattr(layer, n) for n in PACKED))

    def remember(self, layer) -> None:
        self._seen = self._key(layer)

    def is_current(self, layer) -> bool:
        return self._key(layer) == self._seen


class SnapshotCache(_ToyCache):
    """Correct (and slow): keeps a copy of the weights it packed and compares contents."""

    def remember(self, layer) -> None:
        self._snapshot = tuple(getattr(layer, n).detach().clone() for n in PACKED)

    def is_current(self, layer) -> bool:
        return all(a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
                   for a, b in zip((getattr(layer, n).detach() for n in PACKED), self._snapshot))


class CachedToyLayer(MagiMoE):
    """The layer with a toy packed-weight cache following the cache protocol (``weight_cache``
    with ``pack_count`` and ``invalidate()``; ``invalidate_weight_cache()``). It computes with
    the plain PyTorch baseline on whatever the cache hands it."""

    def __init__(self, config: MoEConfig, cache: _ToyCache, **kwargs):
        super().__init__(config, impl="torch-bf16", **kwargs)
        self.weight_cache = cache

    def invalidate_weight_cache(self) -> None:
        self.weight_cache.invalidate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        routes = route(x, self.gate, self.selection_bias, cfg)
        table = build_route_table(routes, cfg)
        with torch.no_grad():
            return expert_reference(x, table, self.weight_cache.weights(self), cfg, precision="bf16")


def stale_cache_layer(config: MoEConfig, state_dict, device=None) -> CachedToyLayer:
    """A layer factory (``make_layer(config, state_dict, device)``) with the stale cache."""
    return CachedToyLayer.from_state_dict(state_dict, config, cache=VersionKeyedCache())


def snapshot_cache_layer(config: MoEConfig, state_dict, device=None) -> CachedToyLayer:
    """A layer factory with the correct snapshot cache."""
    return CachedToyLayer.from_state_dict(state_dict, config, cache=SnapshotCache())




# -- a case that kills its process (for the campaign runner's isolation, not a CONTRACT bug class) --
def _segfault_from_three_tokens(x, table, weights, config, *, out):
    if x.shape[0] >= 3:
        import os
        import signal
        os.kill(os.getpid(), signal.SIGSEGV)  # what an int32 offset does to the interpreter
    return out.copy_(expert_reference(x, table, weights, config, precision="bf16"))


segfault_from_three_tokens = Implementation(
    "broken-segfault", _segfault_from_three_tokens, ("cpu",), "bf16-plain",
    description="BROKEN on purpose: kills its own process with SIGSEGV from 3 tokens on")
