"""int64 offsets: token indices past ``2^31 / row stride`` without 4 GB of real data (CONTRACT 7, 8).

The input is a lazily allocated ``torch.empty(S, H*Dh)`` on the CPU whose untouched pages cost
nothing; only the routed rows are written. The route table is built by hand around those few
tokens (checked with ``validate_route_table``), so ``token * row_stride`` passes 2^31 while the
kernel runs a handful of programs. The kernel writes into a caller-owned accumulator (the atomic
variant's fp32 ``[S, H*Dh]``, equally lazy, with its routed rows zeroed and their unrouted
neighbours set to NaN as guards; the deterministic variant's ``[R, Dh]`` rows), and the routed
rows are compared with the float64 reference computed on just those rows.

An int32 offset makes the load read a wild address, which kills the interpreter's process with
SIGSEGV (and poisons a CUDA context), so every case runs in a child process
(:func:`run_isolated`, ``python -m fuzz.huge``) and a death by signal is reported as such.

Kernels are reached through *launchers* with ``launch_native``'s signature
``launch(x, table, weights, config, accumulator, *, deterministic)``; :data:`LAUNCHERS` maps
implementation names to them. On a GPU an implementation without a launcher can be run through
its ordinary ``forward`` (``mode="forward"``: real memory for the whole input and output).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import strategies as st

from magi_moe.config import MoEConfig, WIDTH_MULTIPLE
from magi_moe.routing import RouteTable, validate_route_table

from .cases import (ExpertCase, RoutingSpec, ValueSpec, build_problem, case_from_dict, case_to_dict,
                    dumps)

__all__ = [
    "INT32_LIMIT", "LAUNCHERS", "HugeCase", "IsolatedResult", "build_huge_problem",
    "first_overflowing_token", "huge_cases", "launcher_for", "register_launcher", "run_huge_case",
    "run_isolated",
]

INT32_LIMIT = 2**31
RESULT_PREFIX = "FUZZ-HUGE-RESULT "
REPO_ROOT = Path(__file__).resolve().parent.parent

# implementation name -> (launcher "package.module:attr", deterministic variant?)
LAUNCHERS: dict[str, tuple[str, bool]] = {
    "native": ("magi_moe.kernels.native:launch_native", False),
    "native-det": ("magi_moe.kernels.native:launch_native", True),
    "fused": ("fuzz.huge:launch_fused_rows", True),
}


def launch_fused_rows(x, table: RouteTable, weights, config: MoEConfig, accumulator: torch.Tensor, *,
                      deterministic: bool = True) -> None:
    """The fused path's expert rows (``launch_route_rows``) into ``accumulator`` ``[R, Dh]``, with
    a lazily allocated ``slot_route`` ``[S*H*K]``; checks that every routed slot points at its
    route (only those pages are ever touched)."""
    from magi_moe.kernels.fused import choose_fused_tiles, launch_route_rows, shared_workspace

    slots = table.num_tokens * config.num_heads * config.top_k
    slot_route = torch.empty(slots, dtype=torch.int32, device=x.device)
    tiles = choose_fused_tiles(config, table.num_routes, x.device)
    launch_route_rows(x, table, weights, config, accumulator, slot_route, tiles=tiles,
                      workspace=shared_workspace(x.device))
    routes = torch.arange(table.num_routes, dtype=torch.int32, device=x.device)
    wrong = slot_route[table.route_slots] != routes
    if bool(wrong.any()):
        raise AssertionError(f"fused slot_route is wrong for {int(wrong.sum())} routed slots")


def register_launcher(impl_name: str, spec: str, *, deterministic: bool) -> None:
    """Let the huge fuzzer reach ``impl_name``'s kernel with a caller-owned accumulator."""
    if ":" not in spec:
        raise ValueError(f"spec must look like 'package.module:attr', got {spec!r}")
    LAUNCHERS[impl_name] = (spec, bool(deterministic))


def launcher_for(impl_name: str) -> tuple[str, bool] | None:
    return LAUNCHERS.get(impl_name)


def first_overflowing_token(config: MoEConfig) -> int:
    """The first token whose row offset ``token * H*Dh`` (in elements) reaches 2^31."""
    return -(-INT32_LIMIT // config.hidden_size)


@dataclass(frozen=True)
class HugeCase:
    """``num_tokens`` tokens of which only ``tokens`` (sorted, distinct) are routed, each to
    ``top_k`` experts in every head; ``seed`` draws their values, experts and weights."""

    config: MoEConfig
    num_tokens: int
    tokens: tuple[int, ...]
    seed: int

    def __post_init__(self) -> None:
        tokens = tuple(sorted(set(int(t) for t in self.tokens)))
        if not tokens or tokens[0] < 0 or tokens[-1] >= self.num_tokens:
            raise ValueError(f"HugeCase.tokens must be non-empty and lie in [0, {self.num_tokens}), "
                             f"got {self.tokens}")
        if self.num_tokens >= INT32_LIMIT:
            raise ValueError(f"HugeCase.num_tokens must fit the int32 gather ids, got {self.num_tokens}")
        object.__setattr__(self, "tokens", tokens)


def huge_cases(*, config: MoEConfig | None = None, max_extra_tokens: int = 4096) -> st.SearchStrategy[HugeCase]:
    """Cases with at least one routed token past the int32 boundary, often mixed in one block
    with tokens below it (token 0, the boundary's neighbours, the last token). Small widths by
    default (``config`` pins one): the cost is the child process, not the kernel."""
    if isinstance(max_extra_tokens, bool) or not isinstance(max_extra_tokens, int) or max_extra_tokens < 1:
        raise ValueError(f"max_extra_tokens must be an int >= 1, got {max_extra_tokens!r}")
    if config is not None and not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig or None, got {type(config).__name__}")
    return _huge_cases(config, max_extra_tokens)


@st.composite
def _huge_cases(draw, config: MoEConfig | None, max_extra_tokens: int) -> HugeCase:
    if config is None:
        E = draw(st.integers(1, 8))
        config = MoEConfig(
            num_heads=draw(st.integers(1, 3)),
            head_dim=WIDTH_MULTIPLE * draw(st.integers(1, 4)),
            num_experts=E, top_k=draw(st.integers(1, E)),
            intermediate_size=WIDTH_MULTIPLE * draw(st.integers(1, 4)),
            route_scale=2.5,
        )
    t0 = first_overflowing_token(config)
    S = t0 + draw(st.integers(1, max_extra_tokens))
    # (t0 + 1 is past the end when S = t0 + 1: the fuzz campaign found that one)
    landmarks = st.sampled_from(sorted({t for t in (0, t0 - 1, t0, t0 + 1, S - 1) if 0 <= t < S}))
    anywhere = st.one_of(landmarks, st.integers(max(0, t0 - 3), S - 1), st.integers(0, S - 1))
    tokens = draw(st.lists(anywhere, min_size=0, max_size=5, unique=True))
    tokens.append(draw(st.integers(t0, S - 1)))  # at least one past the boundary
    return HugeCase(config, S, tuple(tokens), seed=draw(st.integers(0, 2**32 - 1)))


@dataclass
class HugeProblem:
    """``x`` ``[S, H*Dh]`` (lazy; only ``tokens`` rows written), ``table`` (huge token ids),
    and the same routes on just the routed rows: ``small_x`` ``[n, H*Dh]``, ``small_table``
    (route ``r`` of both tables is the same route)."""

    x: torch.Tensor
    table: RouteTable
    weights: object
    tokens: torch.Tensor
    small_x: torch.Tensor
    small_table: RouteTable
    small: object  # the routed rows as a magi_moe.problems.Problem (for the bounds)


def build_huge_problem(case: HugeCase, device: str | torch.device = "cpu") -> HugeProblem:
    cfg, n = case.config, len(case.tokens)
    H, K = cfg.num_heads, cfg.top_k
    small = build_problem(ExpertCase(cfg, n, RoutingSpec("uniform", seed=case.seed),
                                     ValueSpec(seed=case.seed + 1)), device)
    tokens = torch.tensor(case.tokens, dtype=torch.int64, device=device)
    x = torch.empty(case.num_tokens, cfg.hidden_size, dtype=cfg.dtype, device=device)
    x[tokens] = small.x
    st_ = small.table
    local = st_.route_slots // (H * K)
    table = RouteTable(
        gather_ids=tokens[st_.gather_ids.long()].to(torch.int32),
        sorted_probs=st_.sorted_probs, offsets=st_.offsets,
        route_slots=tokens[local] * (H * K) + st_.route_slots % (H * K),
        num_tokens=case.num_tokens, num_heads=H, num_experts=cfg.num_experts, top_k=K,
    )
    validate_route_table(table, cfg)
    return HugeProblem(x, table, small.weights, tokens, small.x, st_, small)


def _load(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _guard_rows(tokens: list[int], num_tokens: int) -> list[int]:
    """Unrouted neighbours of the routed rows: a stray write lands there first."""
    routed = set(tokens)
    return sorted({g for t in tokens for g in (t - 1, t + 1) if 0 <= g < num_tokens and g not in routed})


def run_huge_case(case: HugeCase, *, device: str = "cpu", launcher: str | None = None,
                  deterministic: bool = False, impl: str | None = None) -> dict:
    """Run one case in this process (use :func:`run_isolated`: a broken kernel may kill it).
    Either ``launcher`` (a caller-owned accumulator) or ``impl`` (its ``forward``, real memory)."""
    from magi_moe.kernels.native import reduce_route_rows
    from magi_moe.reference import expert_reference

    from .tolerance import judge

    if (launcher is None) == (impl is None):
        raise ValueError("give exactly one of launcher= and impl=")
    cfg = case.config
    p = build_huge_problem(case, device)
    tokens = case.tokens
    guards = torch.tensor(_guard_rows(list(tokens), case.num_tokens), dtype=torch.int64, device=device)
    guard_ok = True
    if impl is not None:  # the ordinary forward: every element written, unrouted rows zero
        from magi_moe.registry import get_implementation
        implementation = get_implementation(impl)
        out = torch.full_like(p.x, float("nan"), dtype=implementation.output_dtype(p.x.dtype))
        implementation(p.x, p.table, p.weights, cfg, out=out)
        result = out[p.tokens].float()
        guard_ok = bool((out[guards] == 0).all()) if guards.numel() else True
    elif deterministic:
        rows = torch.full((p.table.num_routes, cfg.head_dim), float("nan"), device=device)
        _load(launcher)(p.x, p.table, p.weights, cfg, rows, deterministic=True)
        result = reduce_route_rows(rows, p.small_table, cfg)
    else:
        acc = torch.empty(case.num_tokens, cfg.hidden_size, dtype=torch.float32, device=device)
        acc[p.tokens] = 0.0
        acc[guards] = float("nan")  # a write into a neighbour row shows
        _load(launcher)(p.x, p.table, p.weights, cfg, acc, deterministic=False)
        result = acc[p.tokens]
        guard_ok = bool(torch.isnan(acc[guards]).all()) if guards.numel() else True
    out_small = result.to(cfg.dtype)  # the one final rounding, as native_forward does
    ref = expert_reference(p.small_x, p.small_table, p.weights, cfg, precision="float64")
    base = expert_reference(p.small_x, p.small_table, p.weights, cfg, precision="bf16")
    precision = implementation if impl is not None else "bf16-fp32acc"  # the launchers' model
    verdict = judge(out_small, p.small, precision, ref, base)
    return {"ok": verdict.ok and guard_ok, "guard_ok": guard_ok, "ratio": verdict.ratio,
            "describe": verdict.text, "bound": verdict.source,
            "rows_past_2^31": sum(t >= first_overflowing_token(cfg) for t in tokens)}


@dataclass(frozen=True)
class IsolatedResult:
    returncode: int
    result: dict | None
    output_tail: str

    @property
    def signal_name(self) -> str | None:
        if self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return None

    @property
    def crashed(self) -> bool:
        return self.returncode < 0 or (self.returncode not in (0, 1))


def child_env(backend: str) -> dict[str, str]:
    """The environment of a child that runs ``backend``: the interpreter flag is set (or cleared)
    before anything imports Triton kernels, and the checkout is importable."""
    env = dict(os.environ)
    if backend == "interpret":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_isolated(case: HugeCase, *, backend: str, launcher: str | None = None,
                 deterministic: bool = False, impl: str | None = None,
                 timeout: float = 600) -> IsolatedResult:
    """Run one case in a child process and report how it ended (a negative returncode is the
    signal that killed it, e.g. SIGSEGV from an int32 offset)."""
    cmd = [sys.executable, "-m", "fuzz.huge", "--case", dumps(case_to_dict(case)),
           "--device", "cuda" if backend == "cuda" else "cpu"]
    cmd += ["--launcher", launcher] if launcher else ["--impl", impl or ""]
    if deterministic:
        cmd.append("--deterministic")
    try:
        proc = subprocess.run(cmd, env=child_env(backend), cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return IsolatedResult(-int(signal.SIGKILL), {"timeout": timeout}, out[-3000:])
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    return IsolatedResult(proc.returncode, result, (proc.stdout + proc.stderr)[-3000:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.huge",
                                     description="Run one huge-token case (a child of the fuzzer).")
    parser.add_argument("--case", required=True, help="HugeCase JSON")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--launcher", help="package.module:attr with launch_native's signature")
    parser.add_argument("--impl", help="implementation name (forward mode, real memory)")
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args(argv)
    case = case_from_dict(json.loads(args.case))
    if not isinstance(case, HugeCase):
        parser.error(f"--case must describe a HugeCase, got {type(case).__name__}")
    result = run_huge_case(case, device=args.device, launcher=args.launcher or None,
                           deterministic=args.deterministic, impl=args.impl or None)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    # Run the copy imported as fuzz.huge, so the case classes are the ones fuzz.cases knows.
    from fuzz.huge import main as _main
    sys.exit(_main())
