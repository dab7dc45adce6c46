"""Deliberately broken variants the auditors must catch, and the correct toys they must pass.

Precision (``magi_moe.judge.bounds``): PyTorch emulations that *declare* ``bf16-fp32acc`` but break it.
Determinism (``audit.determinism``): a CPU variant whose output changes in the last bit from run
to run, and the native atomic kernel declaring ``deterministic`` (only a GPU shows it).
Weight cache (``audit.cache``): a layer whose cache is keyed on ``(id, data_ptr, _version)``
(stale after ``param.data.copy_``), and one whose cache compares contents (always fresh).
Discipline (``audit.discipline``, CUDA): a forward with a ``.item()`` in its path, one that
allocates per call, and a disciplined toy that does neither.
"""
from __future__ import annotations

import itertools

import torch

from magi_moe.judge.emulation import FP32ACC_EMULATION, emulated_forward, emulated_implementation
from magi_moe.config import MoEConfig
from magi_moe.layer import MagiMoE
from magi_moe.registry import Implementation
from magi_moe.weights import ExpertWeights

# -- precision -------------------------------------------------------------------------------

BF16_GATE_UP_ACCUMULATION = emulated_implementation(
    "broken-bf16-gate-up", gate_up="working",
    description="BROKEN: gate/up summed in bf16 term by term (declares bf16-fp32acc)")
BF16_DOWN_ACCUMULATION = emulated_implementation(
    "broken-bf16-down", down="working",
    description="BROKEN: down projection summed in bf16 term by term (declares bf16-fp32acc)")
ROUNDS_BEFORE_SWIGLU = emulated_implementation(
    "broken-round-gate-up", round_gate_up=True,
    description="BROKEN: g and u rounded to bf16 before SwiGLU7's clamp (declares bf16-fp32acc)")
BROKEN_PRECISION = (BF16_GATE_UP_ACCUMULATION, BF16_DOWN_ACCUMULATION, ROUNDS_BEFORE_SWIGLU)
CORRECT_EMULATION = FP32ACC_EMULATION

# -- determinism -----------------------------------------------------------------------------

_calls = itertools.count()


def _flaky_forward(x, table, weights, config, *, out):
    """The correct emulation, then the last bit of ~1% of the elements flipped, differently on
    every call (a reduction whose order changes from run to run)."""
    emulated_forward(x, table, weights, config, out=out)
    gen = torch.Generator().manual_seed(next(_calls))
    flip = (torch.rand(out.shape, generator=gen) < 0.01).to(out.device)
    bits = out.view(torch.int16)
    bits ^= flip.to(torch.int16)
    return out


FLAKY_DETERMINISTIC = Implementation(
    "broken-flaky-deterministic", _flaky_forward, ("cpu", "interpret", "cuda"), "bf16-fp32acc",
    capabilities={"deterministic"},
    description="BROKEN: declares deterministic, last bits vary between runs")


def _native_atomic(x, table, weights, config, *, out):
    from magi_moe.kernels.native import native_forward
    return native_forward(x, table, weights, config, deterministic=False, out=out)


ATOMIC_DETERMINISTIC = Implementation(
    "broken-atomic-deterministic", _native_atomic, ("interpret", "cuda"), "bf16-fp32acc",
    capabilities={"deterministic", "int64_offsets"},
    description="BROKEN: the atomic native kernel declaring deterministic")

# -- discipline (CUDA) -----------------------------------------------------------------------


def _disciplined(x, table, weights, config, *, out):
    """Not the MoE: writes every element with no allocation and no host sync (a control)."""
    return torch.mul(x, 0.5, out=out)


def _with_item(x, table, weights, config, *, out):
    _disciplined(x, table, weights, config, out=out)
    out[0, 0].item()  # the host sync under test
    return out


def _allocating(x, table, weights, config, *, out):
    tmp = torch.empty_like(out)
    torch.mul(x, 0.5, out=tmp)
    return out.copy_(tmp)


_DISCIPLINE = dict(backends=("cuda",), precision="bf16-fp32acc",
                   capabilities={"no_host_sync", "int64_offsets"})
DISCIPLINED_TOY = Implementation("toy-disciplined", _disciplined, **_DISCIPLINE,
                                 description="control: no allocation, no sync (not the MoE)")
ITEM_IN_PATH = Implementation("broken-item-in-path", _with_item, **_DISCIPLINE,
                              description="BROKEN: a .item() in the forward")
ALLOCATES_PER_CALL = Implementation("broken-allocates", _allocating, **_DISCIPLINE,
                                    description="BROKEN: allocates a temporary per call")


def with_item_in_path(impl: Implementation) -> Implementation:
    """``impl`` with a ``.item()`` added to its forward (still declaring no_host_sync)."""
    def forward(x, table, weights, config, *, out):
        impl.forward(x, table, weights, config, out=out)
        out[0, 0].item()
        return out
    return Implementation(f"{impl.name}-with-item", forward, impl.backends, impl.precision,
                          dtypes=impl.dtypes, capabilities=impl.capabilities,
                          description=f"BROKEN: {impl.name} with a .item() in its path")

# -- weight cache ----------------------------------------------------------------------------

EXPERT_PARAMS = ("W_gate", "W_up", "W_down")


class ToyWeightCache:
    """Keeps packed (copied) expert weights, following the cache protocol.

    ``key="identity"``: repack when any weight's ``(id, data_ptr, _version)`` changes -- the
    key CONTRACT section 5 warns about (stale after ``param.data.copy_``; ``_version`` raises for
    inference tensors). ``key="contents"``: repack when dtype, device or any value changed --
    correct for every route, at the cost of a full comparison per call. ``key="never"``:
    repack on every call (fresh, but the per-call repack CONTRACT section 5 forbids)."""

    def __init__(self, key: str):
        if key not in ("identity", "contents", "never"):
            raise ValueError(f"key must be 'identity', 'contents' or 'never', got {key!r}")
        self.key = key
        self.pack_count = 0
        self._packed: ExpertWeights | None = None
        self._stamp = None

    def invalidate(self) -> None:
        self._packed, self._stamp = None, None

    def _fresh(self, params) -> bool:
        if self._packed is None or self.key == "never":
            return False
        if self.key == "identity":
            return self._stamp == tuple((id(p), p.data_ptr(), p._version) for p in params)
        return all(p.dtype == q.dtype and p.device == q.device and torch.equal(p, q)
                   for p, q in zip(params, self._packed))

    def weights(self, layer: MagiMoE) -> ExpertWeights:
        params = [getattr(layer, n) for n in EXPERT_PARAMS]
        if not self._fresh(params):
            self._packed = ExpertWeights(*(p.detach().clone() for p in params))
            if self.key == "identity":
                self._stamp = tuple((id(p), p.data_ptr(), p._version) for p in params)
            self.pack_count += 1
        return self._packed


class ToyCachedLayer(MagiMoE):
    """MagiMoE computing from a :class:`ToyWeightCache` (the float64 oracle on the packed copy)."""

    def __init__(self, config: MoEConfig, *, key: str, **kwargs):
        super().__init__(config, impl="reference", **kwargs)
        self.weight_cache = ToyWeightCache(key)

    def expert_weights(self) -> ExpertWeights:
        return self.weight_cache.weights(self)

    def invalidate_weight_cache(self) -> None:
        self.weight_cache.invalidate()


# Layer factories ``make_layer(config, state_dict, device)``, as the auditor builds layers.
def stale_cache_layer(config: MoEConfig, state_dict, device=None) -> ToyCachedLayer:
    return ToyCachedLayer.from_state_dict(state_dict, config, key="identity")


def correct_cache_layer(config: MoEConfig, state_dict, device=None) -> ToyCachedLayer:
    return ToyCachedLayer.from_state_dict(state_dict, config, key="contents")


def repacking_cache_layer(config: MoEConfig, state_dict, device=None) -> ToyCachedLayer:
    return ToyCachedLayer.from_state_dict(state_dict, config, key="never")
