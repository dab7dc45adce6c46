"""The packed gate/up bank and the layer's weight cache (CONTRACT section 5).

Layout: one bank ``[H*E, Dh, 2I]`` per layer, gate in columns ``[0, I)`` and up in ``[I, 2I)``,
so both halves are ``[H*E, Dh, I]`` views with row stride ``2I`` (a layout equivalent to the
``[H*E, 2I, Dh]`` bank of CONTRACT section 4, transposed per expert): the fused kernel reads them
through their strides.

The cache *adopts* the layer's weights instead of copying them: packing copies ``W_gate`` and
``W_up`` into the bank once and then points the two parameters at its halves
(``param.data = view``). There is one copy of gate/up in memory, and the parameters and the bank
are the same memory, which decides what the cache can promise:

* **In-place changes need no repack and cannot leave the bank stale**: ``copy_``/``mul_``/...
  under ``no_grad``, ``load_state_dict`` (which copies in place), ``param.data.copy_(new)``
  (which bypasses the version counter) and writes from inside ``torch.inference_mode`` all write
  the bank itself. The cache reads no ``_version``, so tensors without one are no problem.
* **Swaps are detected and repacked** (``pack_count`` grows by one): ``param.data = new``,
  ``load_state_dict(..., assign=True)``, a new storage (an mmap-backed checkpoint), ``set_``,
  ``module.to(device/dtype)``/``.cuda()``/``.half()``: each leaves a parameter whose pointer,
  strides, dtype or device no longer match the bank's half, which :meth:`PackedWeightCache.ensure`
  checks on every call (a few attribute reads, no device work, no synchronisation). The new
  values are copied into a fresh bank and the parameters point at it; the swapped-in tensor
  is not aliased afterwards, and tensors that aliased the old bank keep the old values.
* **No repack without a change**: a call that finds both halves in place does nothing.
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

import torch

from .validation import check_tensor
from .weights import ExpertWeights


def gate_up_views(bank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a bank ``[H*E, Dh, 2I]``: two ``[H*E, Dh, I]`` views."""
    inter = bank.shape[-1] // 2
    return bank[..., :inter], bank[..., inter:]


def new_bank(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """A bank holding ``w_gate`` and ``w_up`` ``[H*E, Dh, I]`` (a copy; one allocation)."""
    check_tensor("w_gate", w_gate, shape=(None, None, None))
    check_tensor("w_up", w_up, shape=tuple(w_gate.shape), dtype=w_gate.dtype,
                 device=w_gate.device)
    HE, Dh, I = w_gate.shape
    with torch.inference_mode(False), torch.no_grad():
        bank = torch.empty(HE, Dh, 2 * I, dtype=w_gate.dtype, device=w_gate.device)
        gate, up = gate_up_views(bank)
        gate.copy_(w_gate)
        up.copy_(w_up)
    return bank


def is_packed_pair(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """True when ``w_gate``/``w_up`` are the two halves of one bank (no device work)."""
    if w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_gate.dtype != w_up.dtype:
        return False
    HE, Dh, I = w_gate.shape
    want = (Dh * 2 * I, 2 * I, 1)
    return (w_gate.device == w_up.device and w_gate.stride() == want and w_up.stride() == want
            and w_up.data_ptr() == w_gate.data_ptr() + I * w_gate.element_size())


def pack_expert_weights(weights: ExpertWeights) -> ExpertWeights:
    """Weights whose gate/up are views into one new bank (benchmarks and functional callers)."""
    gate, up = gate_up_views(new_bank(weights.w_gate, weights.w_up))
    return ExpertWeights(gate, up, weights.w_down)


class PackedWeightCache:
    """The packed gate/up bank of one layer; see the module docstring for what it promises.

    ``pack_count``: packs done so far (one per weight version that needed one).
    """

    def __init__(self) -> None:
        self.pack_count = 0
        self._bank: torch.Tensor | None = None
        self._stale = False

    @property
    def bank(self) -> torch.Tensor | None:
        """The bank ``[H*E, Dh, 2I]``, or None before the first pack / after invalidate."""
        return None if self._stale else self._bank

    def is_current(self, w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
        """True when the parameters are exactly the two halves of the cache's bank."""
        bank = self.bank
        if bank is None or not is_packed_pair(w_gate, w_up):
            return False
        gate, _ = gate_up_views(bank)
        return (w_gate.data_ptr() == gate.data_ptr() and w_gate.shape == gate.shape
                and w_gate.dtype == bank.dtype and w_gate.device == bank.device)

    def ensure(self, w_gate: torch.nn.Parameter, w_up: torch.nn.Parameter) -> None:
        """Pack unless ``w_gate``/``w_up`` already are the bank's halves; after this they are."""
        if self.is_current(w_gate, w_up):
            return
        self._pack(w_gate, w_up)

    def invalidate(self) -> None:
        """Force a repack into a fresh bank on the next :meth:`ensure` (nothing is freed while
        the parameters still point into the old bank)."""
        self._stale = True

    def _pack(self, w_gate: torch.nn.Parameter, w_up: torch.nn.Parameter) -> None:
        # Always a fresh bank: refilling the old one in place would change tensors that still
        # alias it (a state_dict taken before the swap). The cache lets the old bank go first,
        # so it is freed before the new one is allocated unless someone else still holds it.
        self._bank = None
        with torch.inference_mode(False), torch.no_grad():
            bank = new_bank(w_gate, w_up)
            gate, up = gate_up_views(bank)
            w_gate.data = gate
            w_up.data = up
        self._bank = bank
        self._stale = False
        self.pack_count += 1

    def __repr__(self) -> str:
        bank = self.bank
        where = "empty" if bank is None else f"{tuple(bank.shape)} {bank.dtype} on {bank.device}"
        return f"PackedWeightCache({where}, pack_count={self.pack_count})"
