"""Weight-version swaps: a state machine that interleaves forward passes with every way of
changing weights listed in CONTRACT section 5, on any layer an implementation builds.

The layer is ``impl.layer(config, state_dict, device)`` (or a factory with that signature),
built from a released-layout state dict the machine draws; it is driven through its own
parameters and its own cache, and its *current* weights are read back through
``layer.state_dict()`` (released names). Each forward is checked against the float64 reference
on those weights by the one accuracy judge (:mod:`magi_moe.judge`, same routes, the layer's
declared precision model), so a cache that serves old weights fails at once. Drawn states and changes keep the two router bias tensors
equal, so whichever one the layer selects with, the reference selects with the same values.

Single-tensor changes reach a tensor by ``layer.get_parameter(name)`` / ``get_buffer(name)``;
a change aimed at a name the layer does not have is skipped ("not applicable"). The rest of the
cache protocol is optional and used where the layer offers it:

- pack counts (``layer.pack_count`` or ``layer.weight_cache.pack_count``): a forward packs at
  most once, never when no packed weight changed since the previous forward (router-only
  changes included), and exactly once after an explicit invalidation;
- invalidation (``layer.invalidate_weight_cache()`` or ``layer.weight_cache.invalidate()``);
- promises (``layer.weight_cache_promises`` or ``layer.weight_cache.promises``): a mapping from
  route name (a name of :data:`CHANGES`, or the :mod:`audit.cache` route name it corresponds
  to, :data:`AUDIT_ROUTES`) to ``"needs invalidate()"``. After such a change to a packed weight
  the machine invalidates, as a user must; every other change must be noticed by the layer.

Rules: ``change_<route>(name, then_forward)`` for each route of :data:`CHANGES`,
``invalidate(then_forward)`` and ``forward(tokens, seed)``. One rule per route lets Hypothesis's
swarm testing (a random subset of rules enabled per run) focus a run on a few routes;
``then_forward`` (a token count, or None) checks a forward right after the change, so changes
are checked even in runs where the ``forward`` rule is disabled.

Usage::

    Machine = weight_swap_machine(get_implementation("fused"), config=preset("tiny"))
    run_state_machine_as_test(Machine, settings=...)       # or: TestFused = Machine.TestCase
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Mapping

import torch
from hypothesis import currently_in_test_context
from hypothesis import note as _hypothesis_note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

from magi_moe.audit.cache import reach_tensor
from magi_moe.audit.router_judge import ambiguous_heads, float64_routes
from magi_moe.judge import judge
from magi_moe.judge.precision import precision_model
from magi_moe.config import MoEConfig
from magi_moe.dirty_memory import handed_memory, reserve_for
from magi_moe.implementation import Implementation
from magi_moe.problems import Problem
from magi_moe.routing import build_route_table, route
from magi_moe.verdict import LayerWrongOnItsOwn
from magi_moe.weights import ExpertWeights

from .tolerance import CAMPAIGN_FAILURE_PROBABILITY

__all__ = ["AUDIT_ROUTES", "CHANGES", "EXPERT_PARAMS", "NEEDS_INVALIDATE", "ROUTER_TENSORS",
           "LayerFactory", "WeightSwapMachine", "judge_on_state", "layer_factory_for",
           "weight_swap_machine"]

# The change routes of CONTRACT section 5, by the names the machine's rules use.
CHANGES = (
    "inplace",          # param.mul_(-1) under no_grad
    "copy",             # param.copy_(new) under no_grad
    "load_state_dict",  # layer.load_state_dict(sd): copies in place
    "load_assign",      # layer.load_state_dict(sd, assign=True): new tensors
    "data_assign",      # param.data = new: new storage, _version unchanged
    "data_copy",        # param.data.copy_(new): id, data_ptr and _version all unchanged
    "set_storage",      # param.set_(new): another storage under the same Parameter
    "mmap_checkpoint",  # an mmap-backed checkpoint swapped in with assign=True
    "dtype_roundtrip",  # layer.to(float32), new values, layer.to(config.dtype)
    "device_roundtrip",  # layer.to("cuda"), new values, back (a no-op without a GPU)
    "inference_data",   # param.data = a tensor made under torch.inference_mode()
    "inference_load",   # layer.load_state_dict(sd) inside torch.inference_mode()
)
# The audit.cache route each change corresponds to (promises may use either name).
AUDIT_ROUTES = {"inplace": "in_place", "copy": "copy_no_grad", "load_state_dict": "load_state_dict",
                "load_assign": "load_assign", "data_assign": "param_data_assign",
                "data_copy": "param_data_copy", "mmap_checkpoint": "new_storage",
                "dtype_roundtrip": "to_dtype", "device_roundtrip": "to_device"}
NEEDS_INVALIDATE = "needs invalidate()"
EXPERT_PARAMS = ("W_gate", "W_up", "W_down")
ROUTER_BIASES = ("router.expert_bias", "router.expert_bias_ema")
ROUTER_TENSORS = ("gate",) + ROUTER_BIASES
ALL_TENSORS = EXPERT_PARAMS + ROUTER_TENSORS
_SCALE = {"gate": 0.25, "W_down": 0.1, "W_gate": 0.5, "W_up": 0.5}  # biases: 0.05

LayerFactory = Callable[[MoEConfig, Mapping[str, torch.Tensor], str], nn.Module]


def layer_factory_for(impl: str | Implementation) -> LayerFactory:
    """``impl.layer(config, state_dict, device)`` for a registered name, ``package.module:attr``
    or an Implementation: the implementation's own layer."""
    from magi_moe.registry import get_implementation

    impl = get_implementation(impl)

    def make(config: MoEConfig, state_dict: Mapping[str, torch.Tensor], device) -> nn.Module:
        return impl.layer(config, state_dict, device)
    make.__name__ = f"layer_of_{impl.name.replace('-', '_')}"
    make.precision_for = impl.precision_for  # what weight_swap_machine judges its outputs by
    return make


def note(text: str) -> None:
    """``hypothesis.note`` when running under Hypothesis (steps can also be driven by hand)."""
    if currently_in_test_context():
        _hypothesis_note(text)


def _group(name: str) -> tuple[str, ...]:
    """The tensors a change of ``name`` writes: both router biases move together."""
    return ROUTER_BIASES if name in ROUTER_BIASES else (name,)


def _released_shapes(config: MoEConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    HE, Dh, I = config.num_banks, config.head_dim, config.intermediate_size
    return {"gate": ((HE, Dh), torch.float32), "W_gate": ((HE, Dh, I), config.dtype),
            "W_up": ((HE, Dh, I), config.dtype), "W_down": ((HE, I, Dh), config.dtype),
            "router.expert_bias": ((HE,), torch.float32),
            "router.expert_bias_ema": ((HE,), torch.float32)}


def _as_factory(layer) -> LayerFactory:
    if isinstance(layer, (str, Implementation)):
        return layer_factory_for(layer)
    if callable(layer):
        return layer
    raise TypeError("layer must be an Implementation, its name, or a callable "
                    f"make_layer(config, state_dict, device), got {type(layer).__name__}")


def judge_on_state(y: torch.Tensor, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                   config: MoEConfig, precision, *, rows: torch.Tensor | None = None):
    """The one accuracy judge on a layer's output ``y`` for ``x``, against the float64 reference
    on the weights of ``state`` (released names: the layer's *current* ``state_dict()``), same
    routes. ``rows``: a boolean mask of the rows judged (the others' own input is not finite, so
    they have no reference); all rows when None. Tokens whose top-K is a near-tie
    (:func:`~magi_moe.audit.router_judge.ambiguous_heads`) are set aside: an fp32 router may
    choose either side. Raises AssertionError when the layer changed one router bias without
    the other."""
    bias, ema = state["router.expert_bias"].float(), state["router.expert_bias_ema"].float()
    assert torch.equal(bias, ema), "the layer changed one router bias without the other"
    if rows is not None:
        x, y = x[rows], y[rows]
    gate = state["gate"].detach().float()
    # a token whose top-K is a near-tie may be routed either way by an fp32 router (the routing
    # clause judges that choice): its output has no one reference, so it is set aside here
    settled = ~ambiguous_heads(float64_routes(x, gate, ema, config), config).any(-1)
    if not bool(settled.all()):
        note(f"{int((~settled).sum())} of {len(settled)} tokens set aside: a near-tie top-K")
        settled = settled.to(x.device)
        x, y = x[settled], y[settled]
    routes = route(x, gate, ema, config)
    current = ExpertWeights(*(state[n].detach().to(config.dtype) for n in EXPERT_PARAMS))
    problem = Problem(config, x, gate, ema, current, routes, build_route_table(routes, config))
    return judge(y, problem, precision, failure_probability=CAMPAIGN_FAILURE_PROBABILITY)


class WeightSwapMachine(RuleBasedStateMachine):
    """The weight-swap state machine, for the layer and shapes a subclass names: don't run this
    class itself, take :func:`weight_swap_machine`'s subclass (it validates the arguments and
    adds the rules whose strategies depend on them). The class attributes below are what a
    subclass sets."""

    make_layer: LayerFactory      # (config, state_dict, device) -> the layer under test
    factory_name: str = ""        # how the layer factory is named in notes and the class name
    config: MoEConfig
    device: str = "cpu"
    packed: tuple[str, ...] = EXPERT_PARAMS  # weights whose change may (and must) repack
    precision: str = "bf16-plain"  # the precision model forwards are judged by

    @initialize(seed=st.integers(0, 2**32 - 1))
    def build(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.tmpdir, self.checkpoints = None, 0
        state = {}
        for name, (shape, dtype) in _released_shapes(self.config).items():
            state[name] = self._draw(name, shape, dtype, self.device)
        state["router.expert_bias_ema"] = state["router.expert_bias"].clone()
        self.layer = self.make_layer(self.config, state, self.device)
        missing = [n for n in ALL_TENSORS if n not in self.layer.state_dict()]
        assert not missing, f"layer.state_dict() lacks the released names {missing}"
        self.changed: list[str] = ["built from a state dict"]
        self.invalidated, self.packed_changed = False, True
        self.last_packs = self._packs()
        note(f"layer {type(self.layer).__name__} via {self.factory_name}, {self.config.describe()}, "
             f"device {self.device}")

    def teardown(self) -> None:
        if getattr(self, "tmpdir", None):
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    # -- the optional cache protocol ----------------------------------------------------------------
    def _cache_part(self, attr: str):
        """``layer.<attr>`` else ``layer.weight_cache.<attr>``, or None."""
        for owner in (self.layer, getattr(self.layer, "weight_cache", None)):
            if owner is not None and hasattr(owner, attr):
                return getattr(owner, attr)
        return None

    def _packs(self) -> int | None:
        count = self._cache_part("pack_count") if hasattr(self, "layer") else None
        return None if count is None else int(count)

    def _invalidator(self):
        fn = getattr(self.layer, "invalidate_weight_cache", None)
        if not callable(fn):
            fn = getattr(getattr(self.layer, "weight_cache", None), "invalidate", None)
        return fn if callable(fn) else None

    def _needs_invalidate(self, how: str) -> bool:
        promises = getattr(self.layer, "weight_cache_promises", None)
        if promises is None:
            promises = getattr(getattr(self.layer, "weight_cache", None), "promises", None)
        promises = dict(promises or {})
        return NEEDS_INVALIDATE in (promises.get(how), promises.get(AUDIT_ROUTES.get(how)))

    def _invalidate_now(self, why: str) -> None:
        fn = self._invalidator()
        if fn is None:
            note(f"  {why}, but the layer offers no invalidation")
            return
        fn()
        self.invalidated = True
        note(f"  {why}: invalidated")

    def _changed(self, what: str, names, how: str) -> None:
        names = tuple(names)
        self.changed.append(f"{how}({what})")
        note(f"change: {how} {what}" + (f" (touches {', '.join(names)})" if len(names) > 1 else ""))
        touches_packed = bool(set(names) & set(self.packed))
        if touches_packed and self._needs_invalidate(how):
            self._invalidate_now(f"{how} is promised as {NEEDS_INVALIDATE!r}")
        self.packed_changed = self.packed_changed or touches_packed

    # -- values -----------------------------------------------------------------------------------
    def _draw(self, name: str, shape, dtype, device) -> torch.Tensor:
        new = torch.randn(tuple(shape), generator=self.gen) * _SCALE.get(name, 0.05)
        return new.to(dtype=dtype, device=device)

    def _fresh(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """New values for ``name`` with the shape, dtype and device it has now."""
        t = self.layer.state_dict()[name]
        return self._draw(name, t.shape, dtype or t.dtype, t.device)

    def _mutating(self):
        inference = any(t.is_inference() for t in self.layer.state_dict(keep_vars=True).values())
        return torch.inference_mode() if inference else torch.no_grad()

    def _state_dict_with(self, name: str) -> dict:
        sd = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
        new = self._fresh(name)
        for n in _group(name):
            sd[n] = new.clone()
        return sd

    def _tensors(self, name: str) -> list[torch.Tensor] | None:
        """The layer's own tensors a single-tensor change of ``name`` writes, or None (and a
        note) when the layer has no tensor by one of those names."""
        found = [reach_tensor(self.layer, n) for n in _group(name)]
        if any(t is None for t in found):
            note(f"{name}: not applicable (the layer has no parameter or buffer by that name)")
            return None
        return found

    def _write_each(self, name: str, write) -> tuple[str, ...]:
        """``write(tensor, new)`` on each tensor of ``name``'s group, with one new value."""
        tensors = self._tensors(name)
        if tensors is None:
            return ()
        new = self._fresh(name)
        for t in tensors:
            write(t, new.clone())
        return _group(name)

    def _guarded(self, write):
        """``write`` under :meth:`_mutating`: an in-place write to a parameter that requires
        grad, or to an inference tensor, needs it."""
        def guarded(t, new):
            with self._mutating():
                write(t, new)
        return guarded

    def _write_experts(self, dtype: torch.dtype) -> None:
        """New expert weights (values of ``dtype``) into the layer as its tensors are now."""
        current = self.layer.state_dict()
        sd = {k: v.detach().clone() for k, v in current.items()}
        for n in EXPERT_PARAMS:
            sd[n] = self._fresh(n, dtype).to(current[n].dtype)
        with self._mutating():
            self.layer.load_state_dict(sd)

    # -- the steps the rules take (the rules themselves: weight_swap_machine) -----------------------
    def _change(self, how: str, name: str, then_forward: int | None) -> None:
        """Change ``name`` (or, for the round trips, every expert weight) by route ``how``;
        then forward ``then_forward`` tokens and check them, unless None."""
        touched = getattr(self, f"_{how}")(name)
        if touched:
            self._changed(name, touched, how)
        self._maybe_forward(then_forward)

    def _maybe_forward(self, then_forward: int | None) -> None:
        if then_forward is not None:
            self._check_forward(then_forward, int(torch.randint(2**16, (), generator=self.gen)))

    def _invalidate(self, then_forward: int | None) -> None:
        """Not a weight change: the explicit invalidation (where the layer offers one)."""
        if self._invalidator() is not None:
            self._invalidate_now("invalidate")
        self._maybe_forward(then_forward)

    # -- the change routes of CHANGES, one method each ---------------------------------------------
    def _inplace(self, name):
        tensors = self._tensors(name)
        if tensors is None:
            return ()
        with self._mutating():
            for t in tensors:
                t.mul_(-1)
        return _group(name)

    def _copy(self, name):
        return self._write_each(name, self._guarded(lambda t, new: t.copy_(new)))

    def _load_state_dict(self, name):
        self.layer.load_state_dict(self._state_dict_with(name))
        return ALL_TENSORS  # copies into every tensor

    def _load_assign(self, name):
        self.layer.load_state_dict(self._state_dict_with(name), assign=True)
        return ALL_TENSORS  # every tensor may get a new storage

    def _data_assign(self, name):
        def write(t, new):
            t.data = new
        return self._write_each(name, write)

    def _data_copy(self, name):
        return self._write_each(name, lambda t, new: t.data.copy_(new))

    def _set_storage(self, name):
        return self._write_each(name, self._guarded(lambda t, new: t.set_(new)))

    def _mmap_checkpoint(self, name):
        if self.tmpdir is None:
            self.tmpdir = tempfile.mkdtemp(prefix="fuzz-mmap-")
        path = os.path.join(self.tmpdir, f"ckpt-{self.checkpoints}.pt")
        self.checkpoints += 1
        torch.save({k: v.cpu() for k, v in self._state_dict_with(name).items()}, path)
        sd = torch.load(path, mmap=True, map_location="cpu")
        self.layer.load_state_dict({k: v.to(self.device) for k, v in sd.items()}, assign=True)
        return ALL_TENSORS

    def _dtype_roundtrip(self, name):
        self.layer.to(torch.float32)
        self._write_experts(self.config.dtype)  # values the layer's dtype holds exactly
        self.layer.to(self.config.dtype)
        return ALL_TENSORS

    def _device_roundtrip(self, name):
        if self.device != "cpu" or not torch.cuda.is_available():  # asked here, never at import
            note("device round trip skipped: needs a CPU layer and a GPU")
            return ()
        self.layer.to("cuda")
        self._write_experts(self.config.dtype)
        self.layer.to("cpu")
        return ALL_TENSORS

    def _inference_data(self, name):
        def write(t, new):
            with torch.inference_mode():
                made = new.clone()
            t.data = made
        return self._write_each(name, write)

    def _inference_load(self, name):
        sd = self._state_dict_with(name)
        with torch.inference_mode():
            self.layer.load_state_dict(sd)
        return ALL_TENSORS

    # -- the checks -------------------------------------------------------------------------------
    def _check_forward(self, tokens: int, seed: int) -> None:
        config, device = self.config, self.device
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, config.hidden_size, generator=gen).to(device=device, dtype=config.dtype)
        self._check_output(x, self._forward(x), f"forward({tokens} tokens)")

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on ``x``, on used memory (CONTRACT section 10): what its buffers leave
        unwritten reads as poison, not as a fresh block's zeros."""
        cfg = self.config
        reserve = reserve_for(cfg, x.shape[0], x.shape[0] * cfg.num_heads * cfg.top_k)
        with torch.no_grad(), handed_memory(x.device, reserve_bytes=reserve):
            return self.layer(x)

    def _check_output(self, x: torch.Tensor, y: torch.Tensor, what: str,
                      rows: torch.Tensor | None = None) -> None:
        """Judge the layer's ``y`` for ``x`` on its current weights (only ``rows``, a boolean
        mask, where given) and the pack counts since the previous forward."""
        packs = self._packs()
        verdict = judge_on_state(y, x, self.layer.state_dict(), self.config, self.precision, rows=rows)
        since = ", ".join(self.changed) or "nothing"
        note(f"{what}: ratio {verdict.ratio:.3f}, packs {self.last_packs} -> {packs}")
        # ``changed`` names only the build until the first judged forward (each resets it)
        if not verdict.ok and self.changed == ["built from a state dict"]:
            # The first call on the weights the layer was built with: no change and no earlier
            # call to blame. The layer is wrong on its own (a wrong kernel, router or checkpoint
            # mapping), which the clauses that judge a fresh layer report: this case is NOT RUN.
            raise LayerWrongOnItsOwn(f"{what}, the layer's first call, does not match the "
                                     f"reference on the weights it was built with (see the "
                                     f"checkpoint, routing and accuracy rows): "
                                     f"{verdict.text.splitlines()[0]}")
        assert verdict.ok, (f"{what} after [{since}] does not match the reference on the current "
                            f"weights (stale weights?): {verdict.text}")
        if packs is not None and self.last_packs is not None:
            delta = packs - self.last_packs
            assert 0 <= delta <= 1, f"one forward after [{since}] packed {delta} times"
            if self.invalidated:
                assert delta == 1, f"forward after invalidation packed {delta} times, not once"
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


def _rules(max_tokens: int, tokens: st.SearchStrategy[int] | None = None) -> dict:
    """The rules, whose strategies depend on ``max_tokens``: ``change_<route>(name,
    then_forward)`` for each route of :data:`CHANGES` (its own rule, so swarm testing can enable
    it alone with ``forward``), ``invalidate(then_forward)`` and ``forward(tokens, seed)``.
    ``tokens``: the token counts drawn (default: any in ``[1, max_tokens]``)."""
    tokens = tokens if tokens is not None else st.integers(1, max_tokens)
    names = st.sampled_from(EXPERT_PARAMS * 2 + ROUTER_TENSORS)  # expert weights favoured
    then_forwards = st.none() | tokens

    def change_rule(how: str):
        def step(self, name, then_forward):
            self._change(how, name, then_forward)
        step.__name__ = step.__qualname__ = f"change_{how}"
        step.__doc__ = f"Change a tensor by route {how!r} (see CHANGES)."
        return rule(name=names, then_forward=then_forwards)(step)

    @rule(then_forward=then_forwards)
    def invalidate(self, then_forward):
        """Not a weight change: the explicit invalidation (where the layer offers one)."""
        self._invalidate(then_forward)

    @rule(tokens=tokens, seed=st.integers(0, 2**16))
    def forward(self, tokens, seed):
        self._check_forward(tokens, seed)

    return {f"change_{how}": change_rule(how) for how in CHANGES} | {
        "invalidate": invalidate, "forward": forward}


def sweep_routes(machine: type, *, seed: int = 0, tokens: int = 4) -> None:
    """Every route of :data:`CHANGES` once (on the expert weights in turn), each followed by a
    forward judged on the current weights: the deterministic start of a weight-swap run. A
    random run's first example is Hypothesis's simplest (no step), so a short campaign round
    could end without one change judged, and pass a stale cache."""
    state = machine()
    state.build(seed)
    try:
        for i, how in enumerate(CHANGES):
            state._change(how, EXPERT_PARAMS[i % len(EXPERT_PARAMS)], tokens)
    finally:
        state.teardown()


def weight_swap_machine(layer, *, config: MoEConfig, device: str = "cpu", max_tokens: int = 24,
                        packed: tuple[str, ...] = EXPERT_PARAMS,
                        precision: str | None = None) -> type[WeightSwapMachine]:
    """A :class:`WeightSwapMachine` subclass for the layers of ``layer``: an Implementation, its
    name, or a factory ``make_layer(config, state_dict, device)``.
    ``packed``: the weights whose change may (and must) trigger a repack.
    ``precision``: the precision model forwards are judged by; default the implementation's
    declared one (:func:`layer_factory_for` carries it), else ``bf16-plain`` (plain PyTorch's,
    the loosest) for a factory that declares none."""
    make_layer = _as_factory(layer)
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    precision_for = getattr(make_layer, "precision_for", None)
    precision = (precision or (precision_for(config) if precision_for else None)
                 or getattr(make_layer, "precision", None) or "bf16-plain")
    precision_model(precision, config.dtype)  # an unknown model fails here, not mid-run
    unknown = set(packed) - set(ALL_TENSORS)
    if unknown or not packed:
        raise ValueError(f"packed must be a non-empty subset of {ALL_TENSORS}, got {packed}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    factory_name = getattr(make_layer, "__name__", type(make_layer).__name__)
    name = f"WeightSwaps_{factory_name}"
    return type(WeightSwapMachine)(name, (WeightSwapMachine,), {
        "make_layer": staticmethod(make_layer), "factory_name": factory_name, "config": config,
        "device": device, "packed": tuple(packed), "precision": precision, "__qualname__": name,
        "__module__": __name__, **_rules(max_tokens)})
