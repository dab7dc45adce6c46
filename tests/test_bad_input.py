"""Bad input and nothing lost: every row is a malformed call, the exception it must raise, a
message pattern naming the argument, and a check that nothing the call could touch (weights,
buffers, the table, ``out``, the layer's config) changed before it raised.

Three tables, one per kind of call:

* ``EXPERT_ROWS``: an implementation called on a bad ``(x, table, weights, out)``, run for every
  implementation on every backend (``cpu``: reference, torch-bf16; ``interpret`` and ``cuda``:
  the kernels too);
* ``LAYER_ROWS``: a ``MagiMoE`` method (``load_state_dict``, a module cast, ``forward``) on a
  layer of each backend; on the Triton backends the layer has run the fused path first, so its
  gate/up are packed;
* ``CALL_ROWS``: constructors and builders (``MoEConfig``, ``MagiMoE(...)``, ``build_route_table``).

Rows marked ``child`` crashed the process before they were refused (SIGSEGV: a kernel read
through a strided or edited index tensor): they run in a child process, so a regression fails
one test instead of killing the run (or, on CUDA, poisoning the context for every later test).
Run as a script, this file is that child: ``python tests/test_bad_input.py IMPL BACKEND ROW...``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

# the complex-dtype cast row: torch warns before the layer refuses the cast
pytestmark = pytest.mark.filterwarnings("ignore:Complex modules:UserWarning")

try:  # where magi_moe imports from: the checkout's root, or site-packages for a wheel
    ROOT = Path(__import__("magi_moe").__file__).resolve().parent.parent
except ImportError:  # the child process runs this file as a script from a bare checkout
    ROOT = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(ROOT))

from magi_moe.backends import BACKENDS  # noqa: E402
from magi_moe.config import MoEConfig, preset  # noqa: E402
from magi_moe.fuzz.child import run_capped  # noqa: E402
from magi_moe.fuzz.properties import spec_for  # noqa: E402
from magi_moe.implementation import Implementation  # noqa: E402
from magi_moe.layer import MagiMoE  # noqa: E402
from magi_moe.problems import random_problem, relative_l2, routes_to  # noqa: E402
from magi_moe.registry import get_implementation  # noqa: E402
from magi_moe.routing import Routes, RouteTable, build_route_table  # noqa: E402
from magi_moe.tests.second_device import other_device  # noqa: E402
from magi_moe.weights import ExpertWeights  # noqa: E402

CFG = preset("tiny")  # H=2, Dh=32, E=8, K=2, I=64
S = 12


# ---------------------------------------------------------------------------------------------
# snapshots: "nothing changed" means same values, dtype, device and storage
# ---------------------------------------------------------------------------------------------
def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {name: (t.detach().clone(), t.dtype, t.device, t.data_ptr(), t.stride())
            for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def assert_unchanged(before: dict[str, tuple], tensors: dict[str, torch.Tensor]) -> None:
    for name, (values, dtype, device, ptr, stride) in before.items():
        now = tensors[name]
        assert (now.dtype, now.device, now.data_ptr(), now.stride()) == (dtype, device, ptr, stride), (
            f"{name} was swapped or moved before the call raised")
        assert torch.equal(now.detach(), values) or (
            values.is_floating_point() and torch.equal(now.detach().isnan(), values.isnan())
            and torch.equal(now.detach().nan_to_num(), values.nan_to_num())), (
            f"{name} was written before the call raised")


def raises(exc: type, pattern: str, call: Callable[[], object]) -> None:
    with pytest.raises(exc, match=pattern):
        call()


# ---------------------------------------------------------------------------------------------
# expert computation rows: impl(x, table, weights, config, out=out)
# ---------------------------------------------------------------------------------------------
@dataclass
class ExpertCall:
    """The arguments of one implementation call, made bad by a row's ``make``."""

    x: torch.Tensor
    table: object
    weights: object
    config: object
    out: object

    def tensors(self) -> dict[str, torch.Tensor]:
        found = {"x": self.x, "out": self.out}
        if isinstance(self.table, RouteTable):
            found.update({f"table.{f.name}": getattr(self.table, f.name)
                          for f in dataclasses.fields(self.table) if f.name in
                          ("gather_ids", "sorted_probs", "offsets", "route_slots")})
        if isinstance(self.weights, ExpertWeights):
            found.update(self.weights._asdict())
        return found


def _replace(call: ExpertCall, **fields) -> ExpertCall:
    return dataclasses.replace(call, table=dataclasses.replace(call.table, **fields))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2 (every other element of a wider buffer), the
    gaps filled with values that would be out of range for an index."""
    wide = torch.full((t.numel(), 2), -(10**6) if not t.is_floating_point() else float("nan"),
                      dtype=t.dtype, device=t.device)
    wide[:, 0] = t
    return wide[:, 0]


def _swap_heads_of_token0(call: ExpertCall) -> ExpertCall:
    """Two routes of token 0, one per head, exchange their output slots: every slot stays in
    range and distinct, and each names the token of its route, but the other head."""
    slots = call.table.route_slots.clone()
    K = call.config.top_k
    a = int((slots == 0).nonzero()[0])        # (s=0, h=0, k=0)
    b = int((slots == K).nonzero()[0])        # (s=0, h=1, k=0)
    slots[a], slots[b] = K, 0
    return _replace(call, route_slots=slots)


def _duplicate_slot(call: ExpertCall) -> ExpertCall:
    slots = call.table.route_slots.clone()
    slots[1] = slots[0]
    return _replace(call, route_slots=slots)


def _edit_trusted(field: str, value) -> Callable[[ExpertCall], ExpertCall]:
    """A table built by magi-moe (trusted), then edited in place."""
    def make(call: ExpertCall) -> ExpertCall:
        assert call.table.trusted
        getattr(call.table, field)[0] = value
        assert not call.table.trusted
        return call
    return make


def _edit_trusted_in_inference_mode(call: ExpertCall) -> ExpertCall:
    with torch.inference_mode():
        call.table.gather_ids[0] = 10**8
    return call


def _edit_trusted_offsets(call: ExpertCall) -> ExpertCall:
    call.table.offsets[1:-1].add_(10**6)  # in place through a view
    return call


def _swap_behind_the_dataclass(call: ExpertCall) -> ExpertCall:
    """A fresh tensor (version 0, like the builder's) set on the frozen table directly."""
    object.__setattr__(call.table, "gather_ids", torch.full_like(call.table.gather_ids, 10**8))
    assert not call.table.trusted
    return call


def _stale_fused_route_table(call: ExpertCall) -> ExpertCall:
    """The fused router's table is a view of its workspace: a later call with more tokens
    rewrites the offsets under it (and reallocates the token buffer)."""
    from magi_moe.kernels.router import fused_route

    gen = torch.Generator().manual_seed(5)
    cfg = call.config
    gate = (torch.randn(cfg.num_banks, cfg.head_dim, generator=gen) * 0.25).to(call.x.device)
    first = fused_route(call.x, gate, None, cfg).table
    assert first.trusted
    more = torch.randn(4 * S, cfg.hidden_size, generator=gen).to(call.x)
    fused_route(more, gate, None, cfg)
    assert not first.trusted
    return dataclasses.replace(call, table=first)


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype != torch.float16 else torch.float32


@dataclass(frozen=True)
class ExpertRow:
    id: str
    make: Callable[[ExpertCall], ExpertCall]
    exc: type
    pattern: str
    child: bool = False          # crashed the process before the fix: run in a child process
    triton_only: bool = False    # needs the fused router (a Triton backend)


EXPERT_ROWS = [
    # strided route tables: valid values, read as dense memory by the kernels
    *[ExpertRow(f"strided-{f}", lambda c, f=f: _replace(c, **{f: _strided(getattr(c.table, f))}),
                ValueError, rf"table\.{f} must be contiguous", child=True)
      for f in ("gather_ids", "offsets", "route_slots", "sorted_probs")],
    # trust that survives mutation
    ExpertRow("trusted-then-gather_ids-edited", _edit_trusted("gather_ids", 10**8), ValueError,
              r"table\.gather_ids must lie in \[0, 12\)", child=True),
    ExpertRow("trusted-then-route_slots-edited", _edit_trusted("route_slots", 10**9), ValueError,
              r"table\.route_slots must lie in \[0, {routes}\)", child=True),
    ExpertRow("trusted-then-offsets-edited-through-a-view", _edit_trusted_offsets, ValueError,
              r"table\.offsets must (start at 0 and end|be non-decreasing)", child=True),
    ExpertRow("trusted-then-edited-in-inference-mode", _edit_trusted_in_inference_mode, ValueError,
              r"table\.gather_ids must lie in \[0, 12\)", child=True),
    ExpertRow("trusted-then-tensor-swapped", _swap_behind_the_dataclass, ValueError,
              r"table\.gather_ids must lie in \[0, 12\)", child=True),
    ExpertRow("trusted-then-probs-edited", _edit_trusted("sorted_probs", float("inf")), ValueError,
              r"table\.sorted_probs must be finite"),
    ExpertRow("stale-fused-route-table", _stale_fused_route_table, ValueError,
              r"table\.offsets must start at 0 and end at the route count {routes}, got 0 \.\. {routes4}",
              child=True,
              triton_only=True),
    # inconsistent route slots: in range, so only the full validation sees them
    ExpertRow("duplicate-route-slot", _duplicate_slot, ValueError, r"table\.route_slots must be distinct"),
    ExpertRow("slots-name-another-head", _swap_heads_of_token0, ValueError,
              r"table\.route_slots disagree with the banks' heads"),
    ExpertRow("gather_ids-disagree-with-slots",
              lambda c: _replace(c, gather_ids=c.table.gather_ids.flip(0).contiguous()), ValueError,
              r"table\.route_slots disagree with table\.gather_ids"),
    ExpertRow("offsets-out-of-range", lambda c: _replace(c, offsets=c.table.offsets * 2), ValueError,
              r"table\.offsets must start at 0 and end at the route count {routes}"),
    ExpertRow("table-for-another-config",
              lambda c: dataclasses.replace(c, config=c.config.replace(num_experts=16)), ValueError,
              r"table was built for H=2 E=8 K={top_k}"),
    ExpertRow("table-not-a-route-table",
              lambda c: dataclasses.replace(c, table=tuple(dataclasses.astuple(c.table))), TypeError,
              r"table must be a magi_moe\.routing\.RouteTable"),
    ExpertRow("weights-not-expert-weights",
              lambda c: dataclasses.replace(c, weights=tuple(c.weights)), TypeError,
              r"weights must be a magi_moe\.weights\.ExpertWeights"),
    ExpertRow("config-not-a-config",
              lambda c: dataclasses.replace(c, config=dataclasses.asdict(c.config)), TypeError,
              r"config must be a magi_moe\.config\.MoEConfig"),
    # out: shape, dtype, device checked before anything is computed
    ExpertRow("out-broadcastable-shape",
              lambda c: dataclasses.replace(c, out=torch.full((2, *c.x.shape), float("nan"),
                                                              dtype=c.out.dtype, device=c.x.device)),
              ValueError, r"out must have rank 2"),
    ExpertRow("out-one-row-short", lambda c: dataclasses.replace(c, out=c.out[:-1]), ValueError,
              r"out must have shape \[12, {hidden}\]"),
    ExpertRow("out-wrong-dtype",
              lambda c: dataclasses.replace(c, out=c.out.to(_other_dtype(c.out.dtype))), ValueError,
              r"out must have dtype"),
    ExpertRow("out-not-a-tensor", lambda c: dataclasses.replace(c, out=c.out.tolist()), TypeError,
              r"out must be a torch\.Tensor"),
]


def _expert_call(impl, device: str) -> ExpertCall:
    """A valid call at the nearest config ``impl`` declares (its shape rule and dtypes)."""
    config = impl.fit(CFG)
    p = random_problem(config, S, seed=0, device=device)
    out = torch.full(p.x.shape, float("nan"), dtype=impl.output_dtype(p.x.dtype), device=device)
    return ExpertCall(p.x, p.table, p.weights, config, out)


def expected_message(pattern: str, config: MoEConfig) -> str:
    """A row's pattern for the config its call was built at."""
    routes = S * config.num_heads * config.top_k
    return pattern.format(hidden=config.hidden_size, routes=routes, routes4=4 * routes,
                          top_k=config.top_k)


def run_expert_row(impl, device: str, row: ExpertRow) -> None:
    """Make the bad call, check the exception and that nothing changed (raises AssertionError)."""
    call = _expert_call(impl, device)
    config = call.config
    call = row.make(call)
    before = snapshot(call.tensors())
    raises(row.exc, expected_message(row.pattern, config),
           lambda: impl(call.x, call.table, call.weights, call.config, out=call.out))
    assert_unchanged(before, call.tensors())


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in EXPERT_ROWS])
@pytest.mark.clause("input-checks")
@pytest.mark.needs("input_checks")
def test_expert_call_rejects_bad_input(impl_backend, row: ExpertRow):
    backend = impl_backend.backend
    if row.triton_only and not backend.runs_triton:
        pytest.skip("needs the fused router (a Triton backend)")
    if row.child:
        outcome = child_outcome(spec_for(impl_backend.impl), backend.name, row.id)
        assert outcome == "ok", f"{row.id} on {impl_backend}: {outcome}"
    else:
        run_expert_row(impl_backend.impl, impl_backend.device, row)


@pytest.mark.clause("input-checks")
@pytest.mark.needs("input_checks")
def test_out_on_another_device_is_refused(impl_backend):
    other = other_device(impl_backend.device)
    call = _expert_call(impl_backend.impl, impl_backend.device)
    out = call.out.to(other)
    before = snapshot({**call.tensors(), "out": out})
    raises(ValueError, r"out must be on device", lambda: impl_backend.impl(
        call.x, call.table, call.weights, call.config, out=out))
    assert_unchanged(before, {**call.tensors(), "out": out})


@pytest.mark.clause("inputs-unchanged")
def test_trusted_table_stays_trusted_without_a_change(impl_backend):
    """The control for the trust rows: an unchanged builder table is trusted and runs."""
    call = _expert_call(impl_backend.impl, impl_backend.device)
    assert call.table.trusted and call.table.to(impl_backend.device).trusted
    impl_backend.impl(call.x, call.table, call.weights, call.config, out=call.out)
    assert not call.out.isnan().any() and call.table.trusted


# ---------------------------------------------------------------------------------------------
# child processes for the rows that used to crash
# ---------------------------------------------------------------------------------------------
_CHILD_RESULTS: dict[tuple[str, str], dict[str, str]] = {}


def child_outcome(impl_name: str, backend: str, row_id: str) -> str:
    """Run every child row of (impl, backend) in child processes, once, and return this row's
    outcome: "ok", the assertion that failed, or how the child died. A child that dies takes
    only its current row; the rows after it run in a fresh child."""
    key = (impl_name, backend)
    if key not in _CHILD_RESULTS:
        pending = [r.id for r in EXPERT_ROWS if r.child and (
            BACKENDS[backend].runs_triton or not r.triton_only)]
        results: dict[str, str] = {}
        while pending:
            got, died = _run_child([impl_name, backend, *pending])
            results.update(got)
            pending = [r for r in pending if r not in results]
            if pending:
                results[pending[0]] = died
                pending = pending[1:]
        _CHILD_RESULTS[key] = results
    return _CHILD_RESULTS[key].get(row_id, "not run")


def _run_child(args: list[str], env: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    env = dict(os.environ if env is None else env)
    # magi_moe's import root first; the caller's path kept (an outside implementation lives there)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # under a memory cap of its own: a child that runs out of memory is told from a wild read
    proc = run_capped([sys.executable, str(Path(__file__).resolve()), *args], env=env, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            row_id, outcome = json.loads(line[4:])
            results[row_id] = outcome
    died = (f"the child process died ({proc.end.kind}: {proc.end.text}): "
            f"{proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else ''}")
    return results, died


def _child_main(impl_name: str, backend: str, row_ids: list[str]) -> None:
    impl = get_implementation(impl_name)
    rows = {r.id: r for r in EXPERT_ROWS}
    for row_id in row_ids:
        try:
            run_expert_row(impl, BACKENDS[backend].device, rows[row_id])
            outcome = "ok"
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            outcome = f"{type(exc).__name__}: {str(exc)[:500]}"
        print("ROW " + json.dumps([row_id, outcome]), flush=True)


# ---------------------------------------------------------------------------------------------
# layer rows: load_state_dict, module casts, forward
# ---------------------------------------------------------------------------------------------
LAYER_BACKENDS = [pytest.param("cpu"), pytest.param("interpret", marks=pytest.mark.interpret),
                  pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=LAYER_BACKENDS)
def layer_backend(request) -> str:
    chosen = request.config.getoption("--backend")
    if chosen and request.param not in chosen:
        pytest.skip(f"backend {request.param} not selected with --backend")
    why = BACKENDS[request.param].unavailable_reason()
    if why:
        pytest.skip(f"backend {request.param} unavailable: {why}")
    return request.param


def make_layer(backend: str) -> MagiMoE:
    """A layer of ``backend`` with fresh random weights and biases. ``cpu``: the reference
    implementation; the Triton backends: dispatch (the fused path), run once so gate/up are
    packed into the bank."""
    device = BACKENDS[backend].device
    torch.manual_seed(1)
    kernels = BACKENDS[backend].runs_triton
    layer = MagiMoE(CFG, impl=None if kernels else "reference", device=device)
    with torch.no_grad():
        layer.router.expert_bias.normal_(0.0, 0.05)
        layer.router.expert_bias_ema.normal_(0.0, 0.05)
    if kernels:
        layer(torch.randn(S, CFG.hidden_size, device=device).to(CFG.dtype))
        assert layer.weight_cache.bank is not None
    return layer


def layer_state(layer: MagiMoE) -> dict[str, torch.Tensor]:
    return dict(layer.state_dict(keep_vars=True))


def _checkpoint(layer: MagiMoE, **changes) -> dict[str, torch.Tensor]:
    """New values for every tensor of ``layer`` (so a half-applied load would show), then
    ``changes`` (None deletes a key)."""
    gen = torch.Generator().manual_seed(9)
    sd = {}
    for name, t in layer.state_dict().items():
        sd[name] = (torch.randn(t.shape, generator=gen) * 0.02).to(dtype=t.dtype, device=t.device)
    for name, value in changes.items():
        if value is None:
            sd.pop(name)
        else:
            sd[name] = value(sd[name]) if callable(value) else value
    return sd


def _nan_at(t: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[3] = value
    return t


@dataclass(frozen=True)
class LayerRow:
    id: str
    call: Callable[[MagiMoE], object]
    exc: type
    pattern: str


LAYER_ROWS = [
    # load_state_dict: all or nothing
    LayerRow("load-wrong-shape", lambda m: m.load_state_dict(
        _checkpoint(m, W_down=lambda t: t.transpose(1, 2))), ValueError,
        r"state_dict\['W_down'\] must have shape \[16, 64, 32\]"),
    LayerRow("load-missing-key", lambda m: m.load_state_dict(_checkpoint(m, W_up=None)),
             ValueError, r"missing \['W_up'\]"),
    LayerRow("load-unexpected-key", lambda m: m.load_state_dict(
        {**_checkpoint(m), "extra": torch.zeros(1)}), ValueError, r"unexpected \['extra'\]"),
    LayerRow("load-wrong-shape-non-strict", lambda m: m.load_state_dict(
        _checkpoint(m, W_gate=lambda t: t[:-1], W_up=None), strict=False), ValueError,
        r"state_dict\['W_gate'\] must have shape"),
    LayerRow("load-nan-gate-row", lambda m: m.load_state_dict(_checkpoint(m, gate=_nan_at)),
             ValueError, r"state_dict\['gate'\] must be finite"),
    LayerRow("load-inf-bias", lambda m: m.load_state_dict(_checkpoint(
        m, **{"router.expert_bias_ema": lambda t: _nan_at(t, float("inf"))})), ValueError,
        r"state_dict\['router\.expert_bias_ema'\] must be finite"),
    LayerRow("load-assign-wrong-dtype", lambda m: m.load_state_dict(
        _checkpoint(m, W_down=lambda t: t.float()), assign=True), ValueError,
        r"state_dict\['W_down'\] must have dtype bfloat16 with assign=True"),
    LayerRow("load-assign-router-in-bf16", lambda m: m.load_state_dict(
        _checkpoint(m, gate=lambda t: t.bfloat16()), assign=True), ValueError,
        r"state_dict\['gate'\] must have dtype float32 with assign=True"),
    LayerRow("load-assign-two-devices", lambda m: m.load_state_dict(
        _checkpoint(m, W_down=lambda t: t.to("meta")), assign=True), ValueError,
        r"state_dict: with assign=True every tensor of the layer must end up on one device"),
    LayerRow("load-meta-values", lambda m: m.load_state_dict(
        _checkpoint(m, W_up=lambda t: t.to("meta"))), ValueError,
        r"state_dict\['W_up'\] is on the meta device"),
    LayerRow("load-integer-tensor", lambda m: m.load_state_dict(
        _checkpoint(m, W_down=lambda t: t.to(torch.int32))), ValueError,
        r"state_dict\['W_down'\] must be a floating-point tensor"),
    LayerRow("load-not-a-tensor", lambda m: m.load_state_dict(
        _checkpoint(m, W_down=lambda t: t.tolist())), TypeError,
        r"state_dict\['W_down'\] must be a torch\.Tensor"),
    LayerRow("load-not-a-mapping", lambda m: m.load_state_dict(list(_checkpoint(m).items())),
             TypeError, r"state_dict must be a mapping"),
    # module-wide casts to a dtype the layer cannot run in
    LayerRow("cast-to-complex", lambda m: m.to(torch.complex64), ValueError,
             r"cannot cast the layer to torch\.complex64"),
    # forward
    LayerRow("forward-3d-input", lambda m: m(torch.randn(2, S, CFG.hidden_size, device=m.gate.device)
                                             .to(CFG.dtype)), ValueError, r"x must have rank 2"),
    LayerRow("forward-wrong-dtype", lambda m: m(torch.randn(S, CFG.hidden_size, device=m.gate.device)),
             ValueError, r"x must have dtype bfloat16, got float32"),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in LAYER_ROWS])
def test_layer_rejects_bad_input_and_keeps_its_state(layer_backend, row: LayerRow):
    layer = make_layer(layer_backend)
    state = layer_state(layer)
    before = snapshot(state)
    config, packs = layer.config, getattr(layer.weight_cache, "pack_count", None)
    raises(row.exc, row.pattern, lambda: row.call(layer))
    assert_unchanged(before, layer_state(layer))
    assert layer.config == config
    assert getattr(layer.weight_cache, "pack_count", None) == packs


def test_layer_refuses_input_on_another_device(layer_backend):
    other = other_device(BACKENDS[layer_backend].device)  # make_layer's device
    layer = make_layer(layer_backend)
    before = snapshot(layer_state(layer))
    raises(ValueError, r"x must be on device", lambda: layer(
        torch.randn(S, CFG.hidden_size, device=other).to(CFG.dtype)))
    assert_unchanged(before, layer_state(layer))


# ---------------------------------------------------------------------------------------------
# constructors and builders
# ---------------------------------------------------------------------------------------------
def _routes(device: str, edit=None) -> Routes:
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(CFG.num_experts, generator=gen)[:CFG.top_k]
                       for _ in range(S * CFG.num_heads)]).view(S, CFG.num_heads, CFG.top_k)
    if edit is not None:
        edit(ids)
    return routes_to(ids.to(device), CFG, seed=3)


def _set(index, value):
    def edit(ids):
        ids[index] = value
    return edit


def _no_gpu_device() -> str:
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def _half_width(x, table, weights, config, *, out):
    """Wrong on purpose: one value per pair of columns, [S, H*Dh/2]."""
    return out.view(x.shape[0], -1, 2).mean(-1)


HALF_WIDTH = Implementation("half-width", _half_width, ("cpu", "interpret", "cuda"), "bf16-fp32acc",
                            description="test: returns [S, H*Dh/2]")
RETURNS_NONE = Implementation("returns-none", lambda x, table, weights, config, *, out: None,
                              ("cpu", "interpret", "cuda"), "bf16-fp32acc",
                              description="test: returns nothing")


@dataclass(frozen=True)
class CallRow:
    id: str
    call: Callable[[str], object]    # device -> the bad call
    exc: type
    pattern: str


def _build(edit):
    def call(device):
        routes = _routes(device, edit)
        before = snapshot({"expert_ids": routes.expert_ids, "probs": routes.probs})
        try:
            build_route_table(routes, CFG)
        finally:
            assert_unchanged(before, {"expert_ids": routes.expert_ids, "probs": routes.probs})
    return call


CALL_ROWS = [
    # bad expert ids into build_route_table: refused, never a trusted table
    CallRow("routes-expert-id-E", _build(_set((0, 0, 0), CFG.num_experts)), ValueError,
            r"routes\.expert_ids must lie in \[0, 8\)"),
    CallRow("routes-expert-id-E-in-last-head", _build(_set((S - 1, CFG.num_heads - 1, 1), CFG.num_experts)),
            ValueError, r"routes\.expert_ids must lie in \[0, 8\)"),
    CallRow("routes-expert-id-negative", _build(_set((3, 0, 1), -1)), ValueError,
            r"routes\.expert_ids must lie in \[0, 8\)"),
    CallRow("routes-expert-id-huge", _build(_set((3, 1, 0), 2**40)), ValueError,
            r"routes\.expert_ids must lie in \[0, 8\)"),
    CallRow("routes-repeated-expert", _build(lambda ids: ids[0, 1].fill_(int(ids[0, 1, 0]))),
            ValueError, r"routes\.expert_ids must name 2 distinct experts"),
    CallRow("routes-int32-ids", lambda d: build_route_table(
        Routes(_routes(d).expert_ids.int(), _routes(d).probs), CFG), ValueError,
        r"routes\.expert_ids must have dtype int64"),
    CallRow("routes-integer-probs", lambda d: build_route_table(
        Routes(_routes(d).expert_ids, _routes(d).probs.long()), CFG), ValueError,
        r"routes\.probs must have dtype float32 or float64"),
    # values that passed validation and overflowed later
    CallRow("route_scale-past-fp32", lambda d: CFG.replace(route_scale=1e39), ValueError,
            r"MoEConfig\.route_scale must be a finite float > 0 in fp32's normal range"),
    CallRow("route_scale-below-fp32-normal", lambda d: CFG.replace(route_scale=1e-45), ValueError,
            r"MoEConfig\.route_scale must be a finite float > 0 in fp32's normal range"),
    CallRow("sizes-past-int64", lambda d: MoEConfig(num_heads=2**16, head_dim=2**16, num_experts=2**16,
                                                    top_k=1, intermediate_size=2**16), ValueError,
            r"MoEConfig sizes overflow 64-bit offsets"),
    CallRow("impl-not-a-name", lambda d: MagiMoE(CFG, impl=42, device=d), TypeError,
            r"impl must be None, an implementation name or a magi_moe\.registry\.Implementation"),
    CallRow("impl-unknown-name", lambda d: MagiMoE(CFG, impl="fastest", device=d), ValueError,
            r"implementation must be one of"),
    CallRow("config-a-dict", lambda d: MagiMoE(dataclasses.asdict(CFG), device=d), TypeError,
            r"config must be a magi_moe\.config\.MoEConfig"),
    CallRow("config-a-preset-name", lambda d: MagiMoE("tiny", device=d), TypeError,
            r"config must be a magi_moe\.config\.MoEConfig"),
    CallRow("device-without-a-gpu", lambda d: MagiMoE(CFG, device=_no_gpu_device()), ValueError,
            r"device is 'cuda(:\d+)?' but (no CUDA GPU is available|only \d+ CUDA device)"),
    CallRow("device-misspelt", lambda d: MagiMoE(CFG, device="gpu"), ValueError,
            r"device must be a torch\.device or a device string"),
    CallRow("deterministic-not-a-bool", lambda d: MagiMoE(CFG, deterministic="yes", device=d), TypeError,
            r"deterministic must be a bool"),
    CallRow("preset-a-list", lambda d: preset(["tiny"]), TypeError,
            r"preset name must be a str, one of \[.*\], got list \['tiny'\]"),
    # what the layer hands on must be real and [S, H*Dh], whatever the implementation did
    CallRow("forward-meta-layer-meta-x", lambda d: MagiMoE(CFG, device="meta")(
        torch.empty(S, CFG.hidden_size, dtype=CFG.dtype, device="meta")), ValueError,
        r"x is a meta tensor \(shape only, no data\)"),
    CallRow("forward-meta-layer-real-x", lambda d: MagiMoE(CFG, device="meta")(
        torch.randn(S, CFG.hidden_size, device=d).to(CFG.dtype)), ValueError,
        r"the layer's weights are meta tensors \(no data\): load them first"),
    CallRow("forward-returns-half-width", lambda d: MagiMoE(CFG, impl=HALF_WIDTH, device=d)(
        torch.randn(S, CFG.hidden_size, device=d).to(CFG.dtype)), ValueError,
        rf"impl 'half-width': its forward returned shape \({S}, {CFG.hidden_size // 2}\), "
        rf"expected \({S}, {CFG.hidden_size}\)"),
    CallRow("forward-returns-no-tensor", lambda d: MagiMoE(CFG, impl=RETURNS_NONE, device=d)(
        torch.randn(S, CFG.hidden_size, device=d).to(CFG.dtype)), TypeError,
        r"impl 'returns-none': its forward must return a torch\.Tensor of shape .*, got NoneType"),
    # contradictory options
    CallRow("deterministic-with-native", lambda d: MagiMoE(CFG, deterministic=True, impl="native", device=d),
            ValueError, r"impl: deterministic=True but 'native' does not declare 'deterministic'"),
    CallRow("deterministic-with-torch-bf16", lambda d: MagiMoE(
        CFG, deterministic=True, impl=get_implementation("torch-bf16"), device=d),
        ValueError, r"impl: deterministic=True but 'torch-bf16' does not declare 'deterministic'"),
]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in CALL_ROWS])
def test_constructors_and_builders_reject_bad_input(layer_backend, row: CallRow):
    raises(row.exc, row.pattern, lambda: row.call(BACKENDS[layer_backend].device))


def test_valid_routes_still_build_a_trusted_table(layer_backend):
    table = build_route_table(_routes(BACKENDS[layer_backend].device), CFG)
    assert table.trusted and table.num_routes == S * CFG.num_heads * CFG.top_k


# ---------------------------------------------------------------------------------------------
# a forced Triton implementation in a plain CPU process (no TRITON_INTERPRET): a child process
# ---------------------------------------------------------------------------------------------
PLAIN_CPU_SCRIPT = r"""
import torch
from magi_moe.config import preset
from magi_moe.layer import MagiMoE
from magi_moe.problems import random_problem
from magi_moe.registry import get_implementation
cfg = preset("tiny")
layer = MagiMoE(cfg, impl="fused")
before = {k: v.clone() for k, v in layer.state_dict().items()}
try:
    layer(torch.randn(4, cfg.hidden_size).bfloat16())
except ValueError as exc:
    print("LAYER", exc)
assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
p = random_problem(cfg, 4, seed=0)
for name in ("fused", "native"):
    try:
        get_implementation(name)(p.x, p.table, p.weights, cfg)
    except ValueError as exc:
        print("IMPL", name, exc)
"""


def test_forced_triton_implementation_in_a_plain_cpu_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", PLAIN_CPU_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"LAYER impl: 'fused' runs on the backends .* not on device cpu .*"
                     r"TRITON_INTERPRET=1", proc.stdout), proc.stdout
    for name in ("fused", "native"):
        assert re.search(rf"IMPL {name} x is on cpu, where the Triton kernels cannot run: set "
                         rf"TRITON_INTERPRET=1", proc.stdout), proc.stdout


# ---------------------------------------------------------------------------------------------
# module-wide casts: defined, the layer runs in the new dtype
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cast,dtype", [("half", torch.float16), ("float", torch.float32),
                                        ("double", torch.float64)])
def test_module_casts_run_in_the_new_dtype(layer_backend, cast, dtype):
    layer = make_layer(layer_backend)
    getattr(layer, cast)()
    assert layer.config.dtype == dtype == layer.W_gate.dtype == layer.W_down.dtype
    assert layer.gate.dtype == torch.float32
    device = layer.gate.device
    x = torch.randn(S, CFG.hidden_size, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    with torch.no_grad():
        y = layer(x)
    assert y.dtype == dtype and y.shape == x.shape
    from magi_moe.reference import layer_reference
    weights = ExpertWeights(*(w.detach() for w in layer.expert_weights()))
    ref, _ = layer_reference(x, layer.gate.detach(), layer.selection_bias, weights, layer.config,
                             router_dtype=torch.float32)
    assert relative_l2(y, ref) < (2e-2 if dtype == torch.float16 else 1e-5), relative_l2(y, ref)
    with pytest.raises(ValueError, match="x must have dtype"):
        layer(x.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# checkpoints: a packed layer saves with safetensors and round-trips bitwise
# ---------------------------------------------------------------------------------------------
def test_packed_layer_state_dict_saves_with_safetensors(layer_backend, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    layer = make_layer(layer_backend)
    if layer.weight_cache is None:  # cpu: the reference layer keeps no bank; pack one anyway
        layer = MagiMoE(CFG, impl="fused", device="cpu")
    assert layer.weight_cache.bank is not None, "the test needs a packed layer"
    original = {k: v.detach().cpu().clone() for k, v in layer.state_dict().items()}

    st.save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    loaded = st.load_file(tmp_path / "layer.safetensors")
    assert loaded.keys() == original.keys()
    for name, value in original.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name

    st.save_model(layer, str(tmp_path / "model.safetensors"))
    fresh = MagiMoE(CFG, impl="fused", device=layer.gate.device)
    missing, unexpected = st.load_model(fresh, str(tmp_path / "model.safetensors"),
                                        device=str(layer.gate.device))
    assert not missing and not unexpected
    for name, value in original.items():
        assert torch.equal(fresh.state_dict()[name].cpu(), value), name
    x = torch.randn(S, CFG.hidden_size, device=layer.gate.device).to(CFG.dtype)
    if BACKENDS[layer_backend].runs_triton:
        assert torch.equal(fresh(x), layer(x)), "same weights, same deterministic output"


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2], sys.argv[3:])
