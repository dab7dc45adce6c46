"""The packed gate/up bank and the layer's weight cache (CONTRACT section 5).

Layout: the bank is two dense ``[H*E, Dh, I]`` buffers, gate and up, each its own allocation
(CONTRACT section 4 describes one ``[H*E, 2I, Dh]`` allocation; the fused kernel reads gate and up
through separate pointers and descriptors, so one allocation bought nothing, while views of one
allocation broke checkpoint writers: safetensors refuses tensors that share or only partly
cover a storage). With two dense buffers the layer's ``state_dict()`` saves with safetensors as
it is (no copy), and the native kernel reads the parameters without a per-call copy.

The cache *adopts* the layer's weights instead of copying them: packing copies ``W_gate`` and
``W_up`` into the bank once and then points the two parameters at its buffers
(``param.data = buffer``). There is one copy of gate/up in memory, and the parameters and the
bank are the same memory, which decides what the cache can promise:

* **In-place changes need no repack and cannot leave the bank stale**: ``copy_``/``mul_``/...
  under ``no_grad``, ``load_state_dict`` (which copies in place), ``param.data.copy_(new)``
  (which bypasses the version counter) and writes from inside ``torch.inference_mode`` all write
  the bank itself. The cache reads no ``_version``, so tensors without one are no problem.
* **Swaps are detected and repacked** (``pack_count`` grows by one): ``param.data = new``,
  ``load_state_dict(..., assign=True)``, a new storage (an mmap-backed checkpoint), ``set_``,
  ``module.to(device/dtype)``/``.cuda()``/``.half()``: each leaves a parameter whose pointer,
  strides, dtype or device no longer match the bank's buffer, which
  :meth:`PackedWeightCache.ensure` checks on every call (a few attribute reads, no device work,
  no synchronisation). The new values are copied into the bank and the parameters point at it
  again; the swapped-in tensor is not aliased afterwards.
* **The bank keeps its storage** while shapes, dtype and device stay: a swap refills it in
  place, so a CUDA graph captured before the swap reads the new values once a forward has
  repacked (and never a freed buffer). Tensors that aliased the bank (a ``state_dict()`` taken
  before) see the new values, as after ``load_state_dict``. A new shape, dtype or device
  (``.half()``, ``.to("cuda")``) needs a new bank.
* **No repack without a change**: a call that finds both buffers in place does nothing.
* **Explicit invalidation** (:meth:`PackedWeightCache.invalidate`, or
  ``MagiMoE.invalidate_weight_cache()``): the next call repacks into a fresh bank whatever the
  parameters hold. No change route known to us needs it; it is there for storage surgery the
  pointer check cannot see (resizing a parameter's storage in place, writing through
  ``untyped_storage()`` of a tensor that later becomes the parameter) and to release the bank.
* Even a missed swap would not serve stale weights: the fused kernel reads the parameters'
  current memory through their strides on every call, so the bank is a layout, never a second
  source of truth.

One caveat of adoption: a tensor alias taken *before* the first pack (``w = layer.W_gate.data``)
keeps the old storage. ``MagiMoE(..., impl="fused")`` therefore packs at construction.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .validation import check_tensor
from .weights import ExpertWeights


class GateUpBank(NamedTuple):
    """The packed gate and up weights: two dense ``[H*E, Dh, I]`` tensors, each owning its
    whole allocation."""

    gate: torch.Tensor
    up: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.gate.dtype

    @property
    def device(self) -> torch.device:
        return self.gate.device

    @property
    def shape(self) -> torch.Size:
        return self.gate.shape


def gate_up_views(bank: GateUpBank) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up buffers of a bank."""
    return bank.gate, bank.up


def check_pair(w_gate: torch.Tensor, w_up: torch.Tensor) -> None:
    check_tensor("w_gate", w_gate, shape=(None, None, None))
    check_tensor("w_up", w_up, shape=tuple(w_gate.shape), dtype=w_gate.dtype,
                 device=w_gate.device)


def new_bank(w_gate: torch.Tensor, w_up: torch.Tensor) -> GateUpBank:
    """A bank holding copies of ``w_gate`` and ``w_up`` ``[H*E, Dh, I]``."""
    check_pair(w_gate, w_up)
    with torch.inference_mode(False), torch.no_grad():
        empty = lambda: torch.empty(w_gate.shape, dtype=w_gate.dtype, device=w_gate.device)  # noqa: E731
        bank = GateUpBank(empty(), empty())
        fill_bank(bank, w_gate, w_up)
    return bank


def fill_bank(bank: GateUpBank, w_gate: torch.Tensor, w_up: torch.Tensor) -> None:
    """Copy ``w_gate``/``w_up`` into ``bank`` in place. A source that already is its buffer is
    left alone; one that overlaps the bank otherwise is read from a copy."""
    with torch.inference_mode(False), torch.no_grad():
        sources = [w_gate, w_up]
        for i, src in enumerate(sources):
            if any(_shares_storage(src, buf) for buf in bank) and not _is(src, bank[i]):
                sources[i] = src.clone()
        for buf, src in zip(bank, sources):
            if not _is(src, buf):
                buf.copy_(src)


def _is(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _owns_storage(t: torch.Tensor) -> bool:
    """Dense and covering its whole allocation (what safetensors' ``save_model`` asks)."""
    storage = t.untyped_storage()
    return (t.is_contiguous() and t.data_ptr() == storage.data_ptr()
            and t.numel() * t.element_size() == storage.nbytes())


def is_packed_pair(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """True when ``w_gate``/``w_up`` have the bank's layout: same shape, dtype and device, each
    dense and owning its allocation (no device work)."""
    return (w_gate.dim() == 3 and w_gate.shape == w_up.shape and w_gate.dtype == w_up.dtype
            and w_gate.device == w_up.device and _owns_storage(w_gate) and _owns_storage(w_up)
            and not _shares_storage(w_gate, w_up))


def pack_expert_weights(weights: ExpertWeights) -> ExpertWeights:
    """Weights whose gate/up are a new bank (benchmarks and functional callers)."""
    gate, up = gate_up_views(new_bank(weights.w_gate, weights.w_up))
    return ExpertWeights(gate, up, weights.w_down)


class PackedWeightCache:
    """The packed gate/up bank of one layer; see the module docstring for what it promises.

    ``pack_count``: packs done so far (one per weight version that needed one).
    """

    def __init__(self) -> None:
        self.pack_count = 0
        self._bank: GateUpBank | None = None
        self._stale = False

    @property
    def bank(self) -> GateUpBank | None:
        """The bank, or None before the first pack / after invalidate."""
        return None if self._stale else self._bank

    def is_current(self, w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
        """True when the parameters are exactly the cache's two buffers."""
        bank = self.bank
        return bank is not None and _is(w_gate, bank.gate) and _is(w_up, bank.up)

    def ensure(self, w_gate: torch.nn.Parameter, w_up: torch.nn.Parameter) -> None:
        """Pack unless ``w_gate``/``w_up`` already are the bank's buffers; after this they are."""
        if self.is_current(w_gate, w_up):
            return
        if w_gate.is_meta or w_up.is_meta:
            return  # a skeleton (from_state_dict builds on meta): packed once it holds values
        self._pack(w_gate, w_up)

    def invalidate(self) -> None:
        """Force a repack into a fresh bank on the next :meth:`ensure` (nothing is freed while
        the parameters still point into the old bank)."""
        self._stale = True

    def _pack(self, w_gate: torch.nn.Parameter, w_up: torch.nn.Parameter) -> None:
        check_pair(w_gate, w_up)
        bank = self._bank
        if (not self._stale and bank is not None and bank.shape == w_gate.shape
                and bank.dtype == w_gate.dtype and bank.device == w_gate.device):
            fill_bank(bank, w_gate, w_up)  # same storage: captured CUDA graphs stay valid
        else:
            # A fresh bank: the old one is let go first, so it is freed before the new one is
            # allocated unless someone else still holds it.
            self._bank = None
            bank = new_bank(w_gate, w_up)
        with torch.inference_mode(False), torch.no_grad():
            w_gate.data = bank.gate
            w_up.data = bank.up
        self._bank = bank
        self._stale = False
        self.pack_count += 1

    def __repr__(self) -> str:
        bank = self.bank
        where = "empty" if bank is None else f"2 x {tuple(bank.shape)} {bank.dtype} on {bank.device}"
        return f"PackedWeightCache({where}, pack_count={self.pack_count})"
