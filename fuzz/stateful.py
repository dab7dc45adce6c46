"""Weight-version swaps: a state machine that interleaves forward passes with every way of
changing weights listed in CONTRACT section 5, for layers with a packed-weight cache.

Each forward is checked against the float64 reference on the weights *as they are now* (same
routes, error within :mod:`fuzz.tolerance`'s bound), so a cache that serves old weights fails
at once. The cache protocol (``layer.weight_cache`` with ``pack_count`` and ``invalidate()``,
``layer.invalidate_weight_cache()``) is also held to its cost promise: a forward packs at most
once, never when no packed weight changed since the previous forward (router-only changes
included), and exactly once after an explicit invalidation. Layers without a cache
(``weight_cache is None``) get the correctness checks only.

A cache promises to notice some changes by itself (``weight_cache.promises``, a subset of
:data:`CHANGES`; all of them when absent). After a change it does not promise to notice, the
machine calls ``invalidate_weight_cache()`` as a user must.

Usage::

    Machine = weight_swap_machine(lambda cfg, device: MagiMoE(cfg, impl="fused", device=device),
                                  config=preset("tiny"))
    run_state_machine_as_test(Machine, settings=...)       # or: TestFused = Machine.TestCase
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

import torch
from hypothesis import currently_in_test_context
from hypothesis import note as _hypothesis_note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

from magi_moe.config import MoEConfig
from magi_moe.reference import expert_reference
from magi_moe.routing import build_route_table, route
from magi_moe.weights import ExpertWeights

from .tolerance import differential_report

__all__ = ["CHANGES", "EXPERT_PARAMS", "ROUTER_TENSORS", "LayerFactory", "layer_factory_for",
           "weight_swap_machine"]

# The change routes of CONTRACT section 5, by the names the machine's rules use.
CHANGES = (
    "inplace",          # param.mul_(-1) under no_grad
    "copy",             # param.copy_(new) under no_grad
    "load_state_dict",  # layer.load_state_dict(sd): copies in place
    "load_assign",      # layer.load_state_dict(sd, assign=True): new Parameter objects
    "data_assign",      # param.data = new: new storage, _version unchanged
    "data_copy",        # param.data.copy_(new): id, data_ptr and _version all unchanged
    "set_storage",      # param.set_(new): another storage under the same Parameter
    "mmap_checkpoint",  # an mmap-backed checkpoint swapped in with assign=True
    "dtype_roundtrip",  # layer.to(float32), new values, layer.to(config.dtype)
    "device_roundtrip",  # layer.to("cuda"), new values, back (a no-op without a GPU)
    "inference_data",   # param.data = a tensor made under torch.inference_mode()
    "inference_load",   # layer.load_state_dict(sd) inside torch.inference_mode()
)
EXPERT_PARAMS = ("W_gate", "W_up", "W_down")
ROUTER_TENSORS = ("gate", "router.expert_bias", "router.expert_bias_ema")
ALL_TENSORS = EXPERT_PARAMS + ROUTER_TENSORS

LayerFactory = Callable[[MoEConfig, str], nn.Module]


def layer_factory_for(impl: str) -> LayerFactory:
    """``MagiMoE(config, impl=impl, device=device)``: the registered implementation's layer."""
    from magi_moe.layer import MagiMoE

    def make(config: MoEConfig, device: str) -> nn.Module:
        return MagiMoE(config, impl=impl, device=device)
    make.__name__ = f"magi_moe_{impl}"
    return make


def note(text: str) -> None:
    """``hypothesis.note`` when running under Hypothesis (steps can also be driven by hand)."""
    if currently_in_test_context():
        _hypothesis_note(text)


def _tensor(layer: nn.Module, name: str) -> torch.Tensor:
    obj = layer
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def weight_swap_machine(layer_factory: LayerFactory, *, config: MoEConfig, device: str = "cpu",
                        max_tokens: int = 24, packed: tuple[str, ...] = EXPERT_PARAMS
                        ) -> type[RuleBasedStateMachine]:
    """A ``RuleBasedStateMachine`` class for layers made by ``layer_factory(config, device)``.
    ``packed``: the parameters whose change may (and must) trigger a repack."""
    if not callable(layer_factory):
        raise TypeError("layer_factory must be callable as layer_factory(config, device)")
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    unknown = set(packed) - set(EXPERT_PARAMS + ROUTER_TENSORS)
    if unknown or not packed:
        raise ValueError(f"packed must be a non-empty subset of {EXPERT_PARAMS + ROUTER_TENSORS}, got {packed}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    names = st.sampled_from(EXPERT_PARAMS * 2 + ROUTER_TENSORS)  # packed weights favoured
    routes = CHANGES + ("invalidate",)

    class WeightSwapMachine(RuleBasedStateMachine):
        @initialize(seed=st.integers(0, 2**32 - 1))
        def build(self, seed: int) -> None:
            self.layer = layer_factory(config, device)
            self.gen = torch.Generator().manual_seed(seed)
            self.tmpdir, self.checkpoints = None, 0
            self.changed: list[str] = []
            self.invalidated = self.packed_changed = False
            self.last_packs = self._packs()
            for name in EXPERT_PARAMS + ROUTER_TENSORS:  # seeded values, not the factory's RNG draw
                with torch.no_grad():
                    _tensor(self.layer, name).copy_(self._fresh(name))
            self._changed("initial values", ALL_TENSORS, "copy")
            note(f"layer {type(self.layer).__name__} via {getattr(layer_factory, '__name__', layer_factory)}, "
                 f"{config.describe()}, device {device}")

        def teardown(self) -> None:
            if getattr(self, "tmpdir", None):
                shutil.rmtree(self.tmpdir, ignore_errors=True)

        # -- bookkeeping -----------------------------------------------------------------------
        @property
        def cache(self):
            return getattr(self.layer, "weight_cache", None)

        def _packs(self) -> int | None:
            cache = getattr(self.layer, "weight_cache", None) if hasattr(self, "layer") else None
            return None if cache is None else int(cache.pack_count)

        def _promised(self, how: str) -> bool:
            promises = getattr(self.cache, "promises", None)
            return promises is None or how in set(promises)

        def _changed(self, what: str, names, how: str) -> None:
            names = (names,) if isinstance(names, str) else tuple(names)
            self.changed.append(f"{how}({what})")
            note(f"change: {how} {what}" + (f" (touches {', '.join(names)})" if len(names) > 1 else ""))
            if self.cache is not None and not self._promised(how) and set(names) & set(packed):
                self.layer.invalidate_weight_cache()  # the user's obligation for this route
                self.invalidated = True
                note(f"  {how} is not promised by the cache: invalidate_weight_cache() called")
            self.packed_changed = self.packed_changed or bool(set(names) & set(packed))

        def _fresh(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
            t = _tensor(self.layer, name)
            scale = {"gate": 0.25, "W_down": 0.1}.get(name, 0.5 if name in EXPERT_PARAMS else 0.05)
            new = torch.randn(tuple(t.shape), generator=self.gen) * scale
            return new.to(dtype=dtype or t.dtype, device=t.device)

        def _mutating(self):
            inference = any(_tensor(self.layer, n).is_inference() for n in EXPERT_PARAMS + ("gate",))
            return torch.inference_mode() if inference else torch.no_grad()

        def _state_dict_with(self, name: str) -> dict:
            sd = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
            sd[name] = self._fresh(name)
            return sd

        # -- the change routes (one rule, so forwards stay frequent between changes) -------------
        @rule(how=st.sampled_from(routes), name=names)
        def change(self, how, name):
            """Change ``name`` (or, for the round trips, every expert weight) by route ``how``;
            ``how="invalidate"`` calls ``invalidate_weight_cache()`` instead."""
            touched = getattr(self, f"_{how}")(name)
            if touched:
                self._changed(name, touched, how)

        def _inplace(self, name):
            with self._mutating():
                _tensor(self.layer, name).mul_(-1)
            return name

        def _copy(self, name):
            with self._mutating():
                _tensor(self.layer, name).copy_(self._fresh(name))
            return name

        def _load_state_dict(self, name):
            self.layer.load_state_dict(self._state_dict_with(name))
            return ALL_TENSORS  # copies into every tensor

        def _load_assign(self, name):
            self.layer.load_state_dict(self._state_dict_with(name), assign=True)
            return ALL_TENSORS  # every tensor gets a new storage

        def _data_assign(self, name):
            _tensor(self.layer, name).data = self._fresh(name)
            return name

        def _data_copy(self, name):
            _tensor(self.layer, name).data.copy_(self._fresh(name))
            return name

        def _set_storage(self, name):
            with self._mutating():
                _tensor(self.layer, name).set_(self._fresh(name))
            return name

        def _mmap_checkpoint(self, name):
            if self.tmpdir is None:
                self.tmpdir = tempfile.mkdtemp(prefix="fuzz-mmap-")
            path = os.path.join(self.tmpdir, f"ckpt-{self.checkpoints}.pt")
            self.checkpoints += 1
            torch.save({k: v.cpu() for k, v in self._state_dict_with(name).items()}, path)
            sd = torch.load(path, mmap=True, map_location="cpu")
            self.layer.load_state_dict({k: v.to(device) for k, v in sd.items()}, assign=True)
            return ALL_TENSORS

        def _dtype_roundtrip(self, name):
            self.layer.to(torch.float32)
            with self._mutating():
                for n in EXPERT_PARAMS:
                    _tensor(self.layer, n).copy_(self._fresh(n, config.dtype).float())
            self.layer.to(config.dtype)
            return ALL_TENSORS

        def _device_roundtrip(self, name):
            if device != "cpu" or not torch.cuda.is_available():  # asked here, never at import
                note("device round trip skipped: needs a CPU layer and a GPU")
                return ()
            self.layer.to("cuda")
            with self._mutating():
                for n in EXPERT_PARAMS:
                    _tensor(self.layer, n).copy_(self._fresh(n))
            self.layer.to("cpu")
            return ALL_TENSORS

        def _inference_data(self, name):
            with torch.inference_mode():
                new = self._fresh(name).clone()
            _tensor(self.layer, name).data = new
            return name

        def _inference_load(self, name):
            sd = self._state_dict_with(name)
            with torch.inference_mode():
                self.layer.load_state_dict(sd)
            return ALL_TENSORS

        def _invalidate(self, name):
            """Not a weight change: the explicit invalidation call (a no-op without a cache)."""
            if self.cache is not None:
                self.layer.invalidate_weight_cache()
                self.invalidated = True
                note("invalidate_weight_cache()")
            return ()

        # -- the checks -------------------------------------------------------------------------------
        @rule(tokens=st.integers(1, max_tokens), seed=st.integers(0, 2**16))
        def forward(self, tokens, seed):
            layer = self.layer
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(tokens, config.hidden_size, generator=gen).to(device=device, dtype=config.dtype)
            with torch.no_grad():
                y = layer(x)
            packs = self._packs()
            routes = route(x, layer.gate.detach(), layer.selection_bias, config)
            table = build_route_table(routes, config)
            current = ExpertWeights(*(_tensor(layer, n).detach().to(config.dtype) for n in EXPERT_PARAMS))
            ref = expert_reference(x, table, current, config, precision="float64")
            base = expert_reference(x, table, current, config, precision="bf16")
            report = differential_report(y, ref, base, y.dtype)
            since = ", ".join(self.changed) or "nothing"
            note(f"forward({tokens} tokens): ratio {report.ratio:.3f}, packs {self.last_packs} -> {packs}")
            assert report.ok, (f"forward after [{since}] does not match the reference on the current "
                               f"weights (stale weights?): {report.describe()}")
            if packs is not None:
                delta = packs - self.last_packs
                assert 0 <= delta <= 1, f"one forward after [{since}] packed {delta} times"
                if self.invalidated:
                    assert delta == 1, f"forward after invalidate_weight_cache() packed {delta} times, not once"
                elif not self.packed_changed:
                    assert delta == 0, (f"repacked although no packed weight changed since the last "
                                        f"forward (changes: [{since}])")
            self.last_packs = packs
            self.changed, self.invalidated, self.packed_changed = [], False, False

        @invariant()
        def pack_count_never_decreases(self):
            packs = self._packs()
            if packs is not None and self.last_packs is not None:
                assert packs >= self.last_packs, f"pack_count went down: {self.last_packs} -> {packs}"

    WeightSwapMachine.__name__ = f"WeightSwaps_{getattr(layer_factory, '__name__', 'layer')}"
    WeightSwapMachine.__qualname__ = WeightSwapMachine.__name__
    return WeightSwapMachine

