"""Serving streams: state machines that call ONE layer (or one kernel entry with its weights held
fixed) again and again, the way a server does, and check that no call depends on the calls
before it (contract clause ``history``, CONTRACT section 5).

Every other check judges one call on fresh objects. The bugs these machines look for live across
calls: a launch plan or workspace sized at the first call and reused for a larger one, a plan
cache hit on the wrong side of a tile-table or dispatch edge, weight reloads interleaved with
shape changes, padding rows of a replayed CUDA graph holding whatever was left there.

* :class:`ServingLayerMachine`: the implementation's own layer (``impl.layer``), built once. Its
  rules are the weight-swap machine's (:mod:`fuzz.stateful`: every weight-change route, and
  invalidation) with token counts drawn from :func:`edge_token_counts`, plus ``stream`` (a run
  of calls that grow and shrink), ``forward_dirty`` (rows of NaN/Inf in ``x``: only the rows
  whose own input is finite are judged, and they must stay right) and, on a GPU,
  ``graph_replay`` (captured at a bucket size, replayed with fewer real rows and NaN padding).
* :class:`ServingKernelMachine`: the kernel entry (``impl(x, table, weights, config, out=)``,
  through :func:`magi_moe.problems.run_poisoned`: NaN output and NaN workspaces) with one set of
  weights for the whole run: ``call``, ``stream`` and ``call_dirty``.

Every step judges the real rows against the float64 reference on the *current* weights, same
routes, with the one accuracy judge (:func:`fuzz.stateful.judge_on_state`). Each machine logs
its steps; a failing step's exception carries a note with the one-line replay of the whole
(shrunk) run, ``python -m magi_moe.fuzz.serving_replay '<json>'`` (:mod:`fuzz.serving_replay`).
The same steps can be driven by hand (:func:`growing_stream`, no Hypothesis): the conformance
test and the audit's ``history`` section do.
"""
from __future__ import annotations

import math
import shlex
from typing import Sequence

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from magi_moe.backends import get_backend, plain_twin
from magi_moe.config import MoEConfig
from magi_moe.implementation import Implementation
from magi_moe.problems import Problem, random_problem, run_poisoned
from magi_moe.routing import Routes, build_route_table, route

from .cases import config_from_dict, config_to_dict, dumps
from .stateful import (EXPERT_PARAMS, WeightSwapMachine, _as_factory, _rules, judge_on_state, note,
                       weight_swap_machine)
from .strategies import AWKWARD_TOKEN_COUNTS, Limits
from .tolerance import CAMPAIGN_FAILURE_PROBABILITY

__all__ = ["GARBAGE", "REPLAY_COMMAND", "ServingKernelMachine", "ServingLayerMachine", "drive",
           "edge_token_counts", "growing_steps", "growing_stream", "layer_judged_elsewhere",
           "machine_for", "record_for",
           "replay", "serving_kernel_machine", "serving_layer_machine", "stream_budget",
           "stream_max_tokens"]

REPLAY_COMMAND = "python -m magi_moe.fuzz.serving_replay"
# What a dirty row of x holds: every element NaN, +Inf or -Inf, or a few NaN/Inf among finite ones.
GARBAGE = ("nan", "inf", "-inf", "sprinkled")
_SEEDS = st.integers(0, 2**16)
DISPATCH_EDGE = (4095, 4096, 4097)  # where public stacks switch paths
GPU_MIN_BUDGET = 256.0  # on a GPU streams of tiny and small layers reach past the dispatch edge


# -- the token counts that matter ----------------------------------------------------------------
def stream_budget(device: str | torch.device, budget: float | None = None) -> float:
    """The size budget of a stream on ``device``: ``budget`` (default the loaded profile's,
    :func:`fuzz.profiles.size_budget`), at least :data:`GPU_MIN_BUDGET` on a GPU, where calls
    of thousands of tokens cost little and the dispatch edge is in reach."""
    from .profiles import size_budget

    budget = size_budget() if budget is None else budget
    return max(budget, GPU_MIN_BUDGET) if torch.device(device).type == "cuda" else budget


def stream_max_tokens(config: MoEConfig, budget: float) -> int:
    """The largest token count a stream draws under a size budget (:func:`fuzz.profiles.
    size_budget`): the strategies' route cap (what the interpreter, or a GPU, can afford)."""
    lim = Limits(budget)
    return max(1, min(lim.max_tokens, lim.max_routes // (config.num_heads * config.top_k)))


def _fused_edges(config: MoEConfig, device: torch.device) -> set[int]:
    """Token counts at magi-moe's fused path's keys: the tile table's routes-per-bank edges
    (``R / (H*E)``, R = S*H*K, so S = edge*E/K) and multiples of the row block and the router's
    token block, each with its neighbours."""
    from magi_moe.kernels.tiles import choose_layer_tiles, load_tile_table

    routing, tiles = choose_layer_tiles(config, config.num_heads * config.top_k, device)
    blocks = {tiles.block_m, routing.block_s, tiles.sum_block_t}
    counts = {b * m for b in blocks for m in (1, 2, 3)}
    if device.type == "cuda":
        for edge, _ in load_tile_table(torch.cuda.get_device_name(device)) or ():
            if math.isfinite(edge):
                counts.add(int(edge * config.num_experts / config.top_k))
    return {c + d for c in counts for d in (-1, 0, 1)}


def edge_token_counts(config: MoEConfig, max_tokens: int, *, impl: Implementation | None = None,
                      device: str | torch.device = "cpu") -> tuple[int, ...]:
    """Token counts in ``[1, max_tokens]`` where a plan or a path may switch: the strategies'
    awkward ones, powers of two and their neighbours (4095/4096/4097 among them: public stacks
    switch paths at 4096 tokens) and, for an implementation with a layer path of its own
    (magi-moe's fused one), its tile-table and block edges."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    counts = set(AWKWARD_TOKEN_COUNTS) | {2**p + d for p in range(14) for d in (-1, 0, 1)}
    if impl is not None and impl.layer_forward is not None:
        counts |= _fused_edges(config, torch.device(device))
    return tuple(sorted(c for c in counts if 1 <= c <= max_tokens))


def _token_strategy(edges: Sequence[int], max_tokens: int) -> st.SearchStrategy[int]:
    """An edge most of the time, else any count: edges are where plans switch."""
    return st.sampled_from(list(edges)) | st.integers(1, max_tokens)


# -- dirty rows ------------------------------------------------------------------------------------
def _dirty(x: torch.Tensor, bad: Sequence[int], kind: str, gen: torch.Generator) -> torch.Tensor:
    """``x`` with rows ``bad`` made non-finite by ``kind`` (:data:`GARBAGE`); returns the mask of
    the rows left finite (the real rows)."""
    if kind not in GARBAGE:
        raise ValueError(f"kind must be one of {GARBAGE}, got {kind!r}")
    for r in bad:
        if kind == "sprinkled":
            cols = torch.randint(x.shape[1], (3,), generator=gen)
            x[r, cols[0]], x[r, cols[1]], x[r, cols[2]] = float("nan"), float("inf"), float("-inf")
        else:
            x[r] = float(kind)
    return torch.isfinite(x).all(dim=1)


def _bad_rows(tokens: int, picks: Sequence[int]) -> list[int]:
    """Rows to dirty, from drawn indices; at least one row stays real."""
    return sorted({p % tokens for p in picks} - {tokens - 1} if tokens > 1 else set())


def _input(config: MoEConfig, tokens: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, config.hidden_size, generator=gen).to(device=device, dtype=config.dtype)


# -- the step log and its replay line -----------------------------------------------------------
class _Logged:
    """Steps are logged as ``[op, *args]``; a failing step gets a note with the replay line."""

    record_base: dict  # what replay needs besides the steps (set by the factory)

    def _start_log(self, seed: int) -> None:
        self.log: list = []
        self.seed = seed

    def _logged(self, op: str, *args) -> None:
        self.log.append([op, *args])
        try:
            getattr(self, f"_op_{op}")(*args)
        except Exception as exc:
            exc.add_note(f"  reproduce: {self.replay_line()}")
            raise

    def record(self) -> dict:
        return {**self.record_base, "seed": self.seed, "steps": [list(s) for s in self.log]}

    def replay_line(self) -> str:
        if not self.record_base.get("subject"):
            return "(not replayable: the layer factory is not importable as package.module:attr)"
        return f"{REPLAY_COMMAND} {shlex.quote(dumps(self.record()))}"


# -- the layer machine ------------------------------------------------------------------------------
class ServingLayerMachine(_Logged, WeightSwapMachine):
    """One layer through a serving stream: see the module docstring. Take
    :func:`serving_layer_machine`'s subclass, which sets the class attributes and the rules."""

    edges: tuple[int, ...] = (1,)
    max_tokens: int = 1

    @initialize(seed=st.integers(0, 2**32 - 1))
    def build(self, seed: int) -> None:
        self._start_log(seed)
        WeightSwapMachine.build(self, seed)

    # the weight-swap rules' steps, logged
    def _change(self, how: str, name: str, then_forward: int | None) -> None:
        self._logged("change", how, name, then_forward)

    def _op_change(self, how, name, then_forward):
        WeightSwapMachine._change(self, how, name, then_forward)

    def _invalidate(self, then_forward: int | None) -> None:
        self._logged("invalidate", then_forward)

    def _op_invalidate(self, then_forward):
        WeightSwapMachine._invalidate(self, then_forward)

    def _op_forward(self, tokens: int, seed: int) -> None:
        self._check_forward(tokens, seed)

    def _op_stream(self, counts: list[int], seed: int) -> None:
        for i, tokens in enumerate(counts):
            self._check_forward(tokens, seed + i)

    def _op_dirty(self, tokens: int, seed: int, picks: list[int], kind: str) -> None:
        x = _input(self.config, tokens, seed, self.device)
        real = _dirty(x, _bad_rows(tokens, picks), kind, torch.Generator().manual_seed(seed))
        y = self._forward(x)
        self._check_output(x, y, f"forward({tokens} tokens, {int((~real).sum())} rows {kind})",
                           rows=real)

    def _op_graph(self, bucket: int, real: int, seed: int) -> None:
        """Capture at ``bucket`` rows, replay with ``real`` real rows and NaN padding: the real
        rows must be right on the current weights."""
        from magi_moe.cuda_graphs import capture

        static = _input(self.config, bucket, seed, self.device)
        static[real:] = float("nan")

        def call():
            with torch.no_grad():
                return self.layer(static)
        try:
            graph, y = capture(call)
        except Exception as exc:  # noqa: BLE001 -- capture is the cuda-graph clause's business
            note(f"graph at {bucket} rows: not capturable here ({type(exc).__name__}: {exc})")
            return
        static.copy_(_input(self.config, bucket, seed + 1, self.device))
        static[real:] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
        rows = torch.arange(bucket, device=static.device) < real
        self._check_output(static.clone(), y.clone(), f"graph captured at {bucket} rows, replayed "
                           f"with {real} real rows and NaN padding", rows=rows)
        del graph


def _graph_possible(self) -> bool:
    return torch.device(self.device).type == "cuda" and torch.cuda.is_available()


def _layer_rules(edges: tuple[int, ...], max_tokens: int) -> dict:
    tokens = _token_strategy(edges, max_tokens)
    rules = _rules(max_tokens, tokens)  # change_<route>, invalidate, forward (fuzz.stateful)

    @rule(tokens=tokens, seed=_SEEDS)
    def forward(self, tokens, seed):
        self._logged("forward", tokens, seed)

    @rule(counts=st.lists(tokens, min_size=2, max_size=5), seed=_SEEDS)
    def stream(self, counts, seed):
        """Calls that grow and shrink, nothing in between."""
        self._logged("stream", counts, seed)

    @rule(tokens=tokens, seed=_SEEDS, picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=3),
          kind=st.sampled_from(GARBAGE))
    def forward_dirty(self, tokens, seed, picks, kind):
        self._logged("dirty", tokens, seed, picks, kind)

    @precondition(_graph_possible)
    @rule(bucket=st.sampled_from(list(edges)), fraction=st.floats(0.0, 1.0), seed=_SEEDS)
    def graph_replay(self, bucket, fraction, seed):
        self._logged("graph", bucket, max(1, round(bucket * fraction)), seed)

    return rules | {"forward": forward, "stream": stream, "forward_dirty": forward_dirty,
                    "graph_replay": graph_replay}


def _subject_spec(layer) -> str | None:
    """How a fresh process loads the layer's maker: an implementation's spec, or a factory's
    ``package.module:attr``; None when neither."""
    if isinstance(layer, Implementation):
        from .properties import spec_for
        return spec_for(layer)
    if isinstance(layer, str):
        return layer
    module, name = getattr(layer, "__module__", None), getattr(layer, "__qualname__", "")
    if module and name and "<" not in name and module != "__main__":
        return f"{module}:{name}"
    return None


def serving_layer_machine(layer, *, config: MoEConfig, device: str = "cpu",
                          max_tokens: int | None = None, budget: float | None = None,
                          packed: tuple[str, ...] = EXPERT_PARAMS,
                          precision: str | None = None) -> type[ServingLayerMachine]:
    """A :class:`ServingLayerMachine` for the layers of ``layer`` (an Implementation, its name, or
    a factory ``make_layer(config, state_dict, device)``), arguments as
    :func:`~fuzz.stateful.weight_swap_machine`'s. ``max_tokens``: the largest call (default
    :func:`stream_max_tokens` at :func:`stream_budget`; ``budget`` None: the loaded profile's)."""
    from magi_moe.registry import get_implementation

    impl = get_implementation(layer) if isinstance(layer, str) else layer
    if max_tokens is None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        max_tokens = stream_max_tokens(config, stream_budget(device, budget))
    if precision is None and isinstance(impl, Implementation) and impl.is_oracle:
        precision = "bf16-plain"  # the oracle's layer rounds its float64 result to x's dtype
    base = weight_swap_machine(_as_factory(impl), config=config, device=device,
                               max_tokens=max_tokens, packed=packed, precision=precision)
    edges = edge_token_counts(config, max_tokens, impl=impl if isinstance(impl, Implementation)
                              else None, device=device)
    name = f"ServingStream_{base.factory_name}"
    attrs = {k: base.__dict__[k] for k in ("make_layer", "factory_name", "config", "device",
                                           "packed", "precision")}
    record_base = {"machine": "layer", "subject": _subject_spec(impl), "device": device,
                   "config": config_to_dict(config), "max_tokens": max_tokens,
                   "packed": list(packed), "precision": base.precision}
    return type(ServingLayerMachine)(name, (ServingLayerMachine,), {
        **attrs, "edges": edges, "max_tokens": max_tokens, "record_base": record_base,
        "__qualname__": name, "__module__": __name__, **_layer_rules(edges, max_tokens)})


# -- the kernel-entry machine ---------------------------------------------------------------------
class ServingKernelMachine(_Logged, RuleBasedStateMachine):
    """The kernel entry, one set of weights for the whole run: see the module docstring. Take
    :func:`serving_kernel_machine`'s subclass."""

    impl: Implementation
    config: MoEConfig
    device: str = "cpu"
    edges: tuple[int, ...] = (1,)
    max_tokens: int = 1

    @initialize(seed=st.integers(0, 2**32 - 1))
    def build(self, seed: int) -> None:
        self._start_log(seed)
        drawn = random_problem(self.config, 1, seed=seed, device=self.device)
        self.gate, self.bias, self.weights = drawn.gate, drawn.bias, drawn.weights
        self.calls = 0
        note(f"kernel entry {self.impl.name}, {self.config.describe()}, device {self.device}, "
             f"weights held fixed")

    def _call_and_judge(self, tokens: int, seed: int, picks=(), kind: str = "nan") -> None:
        cfg = self.config
        x = _input(cfg, tokens, seed, self.device)
        routes = route(x, self.gate, self.bias, cfg)  # routed on the clean rows
        real = _dirty(x, _bad_rows(tokens, picks), kind, torch.Generator().manual_seed(seed))
        table = build_route_table(routes, cfg)
        out = run_poisoned(self.impl, Problem(cfg, x, self.gate, self.bias, self.weights, routes, table))
        kept = Routes(routes.expert_ids[real], routes.probs[real])
        problem = Problem(cfg, x[real], self.gate, self.bias, self.weights, kept,
                          build_route_table(kept, cfg))
        from magi_moe.judge import Inaccurate, judge

        verdict = judge(out[real], problem, self.impl, failure_probability=CAMPAIGN_FAILURE_PROBABILITY)
        self.calls += 1
        what = f"call {self.calls} ({tokens} tokens" + (
            f", {int((~real).sum())} rows {kind})" if picks else ")")
        note(f"{what}: ratio {verdict.ratio:.3f}")
        failure = verdict.failure(f"{what}, the first call, does not match the reference: ")
        if self.calls == 1 and isinstance(failure, Inaccurate):
            # the first call: no earlier call to keep a plan or workspace from, so the kernel is
            # simply inaccurate (the verdict counts it under accuracy where accuracy fails)
            raise failure
        assert verdict.ok, (f"{what} on weights held fixed does not match the reference (a plan "
                            f"or workspace kept from an earlier call?): {verdict.text}")

    def _op_call(self, tokens: int, seed: int) -> None:
        self._call_and_judge(tokens, seed)

    def _op_stream(self, counts: list[int], seed: int) -> None:
        for i, tokens in enumerate(counts):
            self._call_and_judge(tokens, seed + i)

    def _op_dirty(self, tokens: int, seed: int, picks: list[int], kind: str) -> None:
        self._call_and_judge(tokens, seed, picks, kind)

    def teardown(self) -> None:
        pass


def _kernel_rules(edges: tuple[int, ...], max_tokens: int) -> dict:
    tokens = _token_strategy(edges, max_tokens)

    @rule(tokens=tokens, seed=_SEEDS)
    def call(self, tokens, seed):
        self._logged("call", tokens, seed)

    @rule(counts=st.lists(tokens, min_size=2, max_size=5), seed=_SEEDS)
    def stream(self, counts, seed):
        self._logged("stream", counts, seed)

    @rule(tokens=tokens, seed=_SEEDS, picks=st.lists(st.integers(0, 2**16), min_size=1, max_size=3),
          kind=st.sampled_from(GARBAGE))
    def call_dirty(self, tokens, seed, picks, kind):
        self._logged("dirty", tokens, seed, picks, kind)

    return {"call": call, "stream": stream, "call_dirty": call_dirty}


def serving_kernel_machine(impl, *, config: MoEConfig, device: str = "cpu",
                           max_tokens: int | None = None, budget: float | None = None
                           ) -> type[ServingKernelMachine]:
    """A :class:`ServingKernelMachine` for ``impl`` (an Implementation, its name or
    ``package.module:attr``) at ``config`` on ``device``."""
    from magi_moe.registry import get_implementation

    impl = get_implementation(impl)
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    if max_tokens is None:
        max_tokens = stream_max_tokens(config, stream_budget(device, budget))
    edges = edge_token_counts(config, max_tokens, impl=impl, device=device)
    name = f"ServingKernel_{impl.name.replace('-', '_')}"
    from .properties import spec_for

    record_base = {"machine": "kernel", "subject": spec_for(impl), "device": device,
                   "config": config_to_dict(config), "max_tokens": max_tokens}
    return type(ServingKernelMachine)(name, (ServingKernelMachine,), {
        "impl": impl, "config": config, "device": device, "edges": edges, "max_tokens": max_tokens,
        "record_base": record_base, "__qualname__": name, "__module__": __name__,
        **_kernel_rules(edges, max_tokens)})


def layer_judged_elsewhere(impl: Implementation, backend: str) -> str | None:
    """Why a stream on ``impl``'s layer adds nothing on ``backend``, or None: magi-moe's kernels
    without a layer path of their own (native, native-det) run under the interpreter in the
    same generic layer as the reference, whose streams run at reference@cpu; their kernel
    entry's streams still run."""
    from magi_moe.impls import BUILTINS

    twin = plain_twin(get_backend(backend))
    if impl in BUILTINS and impl.layer_forward is None and twin is not None and twin.name != backend:
        return f"the generic MagiMoE layer is judged at reference@{twin.name}"
    return None


# -- by hand: the deterministic stream, and replay -------------------------------------------------
def growing_stream(edges: Sequence[int]) -> list[int]:
    """A fixed stream over ``edges``: small, growing through about a quarter of them up to the
    largest, then back down to small and a middle one. No Hypothesis: the same calls each run."""
    e = sorted(set(edges))
    up = sorted(set(e[::max(1, len(e) // 4)] + [c for c in DISPATCH_EDGE if c in e] + [e[-1]]))
    return up + [e[0], e[len(e) // 2]]


def record_for(machine: type, seed: int, steps: Sequence[Sequence]) -> dict:
    """The record :func:`replay` runs: ``steps`` on ``machine`` built from ``seed``."""
    return {**machine.record_base, "seed": seed, "steps": [list(s) for s in steps]}


def drive(machine: type, seed: int, steps: Sequence[Sequence]) -> _Logged:
    """Run ``steps`` (``[op, *args]``, as a machine logs them) on a fresh instance of
    ``machine`` built from ``seed``; raises what the failing step raised, or, where that step
    alone on a fresh instance fails as its first call, what that raises (below)."""
    m = machine()
    try:
        m.build(seed)
        for i, (op, *args) in enumerate(steps):
            try:
                m._logged(op, *args)
            except AssertionError as exc:
                _raise_if_wrong_alone(machine, seed, steps[:i], [op, *args], exc)
                raise
    finally:
        m.teardown()
    return m


# The steps that change no weight and make one call: repeated alone, they are a first call.
_SINGLE_CALLS = ("call", "forward", "dirty")


def _raise_if_wrong_alone(machine: type, seed: int, before: Sequence[Sequence], step: list,
                          failure: AssertionError) -> None:
    """One root cause, one row: a call that failed in the middle of a stream is repeated alone
    on a fresh instance, where it is the first call. Wrong there too, it says nothing about
    history: the first-call rule's exception (the kernel entry: ``Inaccurate``, counted under
    accuracy; a layer: ``LayerWrongOnItsOwn``, NOT RUN) is raised instead, its replay line
    that of the call alone. Only for deterministic drives: inside a Hypothesis run the extra
    call would change an implementation's own caches between the examples it compares."""
    from magi_moe.judge import Inaccurate
    from magi_moe.verdict import LayerWrongOnItsOwn

    if step[0] not in _SINGLE_CALLS or any(s[0] not in _SINGLE_CALLS for s in before):
        return  # a weight change came first: the fresh instance would call other weights
    fresh = machine()
    try:
        fresh.build(seed)
        fresh._logged(*step)
    except (Inaccurate, LayerWrongOnItsOwn) as alone:
        alone.add_note(f"  (step {len(before) + 1} of the stream, {step[0]}{tuple(step[1:])}, "
                       f"failed; alone on a fresh instance it fails as its first call)")
        raise alone from failure
    except Exception:  # noqa: BLE001 -- anything else: the stream's own failure stands
        return
    finally:
        fresh.teardown()


def growing_steps(machine: type, *, seed: int = 0, change: str | None = "load_state_dict") -> list:
    """The steps of the deterministic check: :func:`growing_stream` over the machine's edges
    one call at a time, a dirty-row call, and (layer machines, ``change``) a weight change by
    that route between the growing and the shrinking half; on a GPU, a layer machine ends with a
    graph captured at the largest count and replayed with about half of it real."""
    counts = growing_stream(machine.edges)
    forward = "forward" if issubclass(machine, ServingLayerMachine) else "call"
    steps = [[forward, n, seed + i] for i, n in enumerate(counts)]
    if change and issubclass(machine, ServingLayerMachine):
        steps.insert(len(counts) - 2, ["change", change, "W_up", None])
    steps.append(["dirty", counts[-1], seed + len(counts), [0], "nan"])
    if forward == "forward" and torch.device(machine.device).type == "cuda":
        bucket = max(counts)
        steps.append(["graph", bucket, bucket // 2 + 1, seed + len(counts) + 1])
    return steps


def _load_subject(spec: str):
    """A registered implementation's name, else ``package.module:attr``: an Implementation or a
    layer factory ``make_layer(config, state_dict, device)``, as it is."""
    import importlib

    from magi_moe.registry import get_implementation

    module, _, attr = spec.partition(":")
    if not attr:
        return get_implementation(spec)
    return getattr(importlib.import_module(module), attr)


def machine_for(record: dict) -> type:
    """The machine class a logged stream ran on (:meth:`_Logged.record`); raises ValueError,
    ImportError or AttributeError when it cannot be built here."""
    missing = [k for k in ("machine", "subject", "device", "config", "max_tokens", "seed", "steps")
               if k not in record]
    if missing:
        raise ValueError(f"record must hold {missing}")
    config = config_from_dict(record["config"])
    if record["machine"] == "kernel":
        return serving_kernel_machine(record["subject"], config=config, device=record["device"],
                                      max_tokens=record["max_tokens"])
    if record["machine"] == "layer":
        return serving_layer_machine(_load_subject(record["subject"]), config=config,
                                     device=record["device"], max_tokens=record["max_tokens"],
                                     packed=tuple(record.get("packed", EXPERT_PARAMS)),
                                     precision=record.get("precision"))
    raise ValueError(f"record machine must be 'layer' or 'kernel', got {record['machine']!r}")


def replay(record: dict) -> _Logged:
    """Run a logged stream again exactly; raises where it fails."""
    return drive(machine_for(record), record["seed"], record["steps"])
