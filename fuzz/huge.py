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
(:func:`run_isolated`, ``python -m fuzz.huge``) under a memory cap of its own, and how it ended
is told apart (:mod:`fuzz.child`): a wild read (SIGSEGV, SIGBUS, a CUDA illegal address) is the
offset finding; a child that ran out of memory "needs more than N GiB at this case", a resource
result, never a finding, and never takes the machine down; a timeout is a class of its own.

An implementation is reached through the ``launcher`` it declares
(:class:`~magi_moe.implementation.RowLauncher`: a caller-owned accumulator, so only the routed
rows' pages are touched), or else through its ordinary ``forward``: then ``x`` stays lazy but
the whole output is real memory (about 4.3 GB of bf16 at any width, since the row offset passes
2^31 elements), which the CPU and a GPU both afford. A shape outside the implementation's
declared ``supports`` is reported as unsupported; an error inside it is a failure.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import magi_moe
from magi_moe.backends import BACKENDS, get_backend
from magi_moe.routing import RouteTable, validate_route_table

from .cases import (ExpertCase, HugeCase, RoutingSpec, ValueSpec, build_problem, case_from_dict,
                    case_to_dict, dumps, first_overflowing_token)
from .child import ChildEnd, run_capped

__all__ = ["IsolatedResult", "build_huge_problem", "run_huge_case", "run_isolated"]

RESULT_PREFIX = "FUZZ-HUGE-RESULT "
# Where ``magi_moe`` imports from: the checkout's root, or site-packages for an installed wheel.
REPO_ROOT = Path(magi_moe.__file__).resolve().parent.parent


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


def run_huge_case(case: HugeCase, *, impl: str, device: str = "cpu", mode: str = "launcher") -> dict:
    """Run one case in this process (use :func:`run_isolated`: a broken kernel may kill it).

    ``impl``: how to load the implementation (a registered name or ``package.module:attr``).
    ``mode="launcher"``: through its declared :class:`~magi_moe.implementation.RowLauncher`
    (a caller-owned accumulator); ``mode="forward"``: its ordinary ``forward`` (real output)."""
    from magi_moe.judge import judge
    from magi_moe.registry import get_implementation

    from .tolerance import CAMPAIGN_FAILURE_PROBABILITY

    implementation = get_implementation(impl)
    if mode not in ("launcher", "forward"):
        raise ValueError(f"mode must be 'launcher' or 'forward', got {mode!r}")
    launcher = implementation.launcher
    if mode == "launcher" and launcher is None:
        raise ValueError(f"{implementation.name} declares no launcher; use mode='forward'")
    cfg = case.config
    p = build_huge_problem(case, device)
    tokens = case.tokens
    guards = torch.tensor(_guard_rows(list(tokens), case.num_tokens), dtype=torch.int64, device=device)
    guard_ok = True
    if mode == "forward":  # every element written, unrouted rows zero
        out = torch.full_like(p.x, float("nan"), dtype=implementation.output_dtype(p.x.dtype))
        implementation(p.x, p.table, p.weights, cfg, out=out)
        result = out[p.tokens].float()
        guard_ok = bool((out[guards] == 0).all()) if guards.numel() else True
        del out
    elif launcher.writes == "route_rows":
        from magi_moe.kernels.native import reduce_route_rows  # Triton, only for a launcher

        rows = torch.full((p.table.num_routes, cfg.head_dim), float("nan"), device=device)
        _load(launcher.spec)(p.x, p.table, p.weights, cfg, rows, deterministic=True)
        result = reduce_route_rows(rows, p.small_table, cfg)
    else:
        acc = torch.empty(case.num_tokens, cfg.hidden_size, dtype=torch.float32, device=device)
        acc[p.tokens] = 0.0
        acc[guards] = float("nan")  # a write into a neighbour row shows
        _load(launcher.spec)(p.x, p.table, p.weights, cfg, acc, deterministic=False)
        result = acc[p.tokens]
        guard_ok = bool(torch.isnan(acc[guards]).all()) if guards.numel() else True
    out_small = result.to(cfg.dtype)  # the one final rounding, as the forwards do
    verdict = judge(out_small, p.small, implementation, failure_probability=CAMPAIGN_FAILURE_PROBABILITY)
    return {"ok": verdict.ok and guard_ok, "guard_ok": guard_ok, "ratio": verdict.ratio,
            "describe": verdict.text, "decided_by": verdict.criterion, "mode": mode,
            "rows_past_2^31": sum(t >= first_overflowing_token(cfg) for t in tokens)}


@dataclass(frozen=True)
class IsolatedResult:
    """How one case's child ended: ``end`` its class (:mod:`fuzz.child`: ``exited``, ``memory``,
    ``wild_read``, ``timeout``, ``crash``), ``result`` what it printed when it ran to the end."""

    returncode: int
    result: dict | None
    output_tail: str
    end: ChildEnd = ChildEnd("exited", "")

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
    """The environment of a child that runs ``backend``: its variables set, the other backends'
    cleared (``TRITON_INTERPRET``) before anything imports Triton kernels, and the checkout is importable, and so is the
    current directory (where ``--impl package.module:attr`` was named; the child runs elsewhere)."""
    env = get_backend(backend).child_env()
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, [str(REPO_ROOT), os.getcwd(),
                                                                     env.get("PYTHONPATH")])))
    return env


def run_isolated(case: HugeCase, *, backend: str, impl: str, mode: str = "launcher",
                 timeout: float = 600, memory_cap: int | None = None) -> IsolatedResult:
    """Run one case in a child process under a memory cap of its own (``memory_cap`` bytes,
    default :func:`fuzz.child.default_memory_cap`) and a time limit, and report how it ended
    (``end``): a wild read (SIGSEGV from an int32 offset), memory, a timeout, or its result."""
    cmd = [sys.executable, "-m", "magi_moe.fuzz.huge", "--case", dumps(case_to_dict(case)),
           "--device", get_backend(backend).device, "--impl", impl, "--mode", mode]
    run = run_capped(cmd, env=child_env(backend), cwd=REPO_ROOT, timeout=timeout,
                     memory_cap=memory_cap)
    result = None
    if run.end.kind == "exited":
        for line in run.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
    return IsolatedResult(run.returncode, result, (run.stdout + run.stderr)[-3000:], run.end)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz.huge",
                                     description="Run one huge-token case (a child of the fuzzer).")
    parser.add_argument("--case", required=True, help="HugeCase JSON")
    devices = tuple(dict.fromkeys(b.device for b in BACKENDS.values()))  # cpu, cuda
    parser.add_argument("--device", default="cpu", choices=devices)
    parser.add_argument("--impl", required=True,
                        help="implementation: a registered name or package.module:attr")
    parser.add_argument("--mode", default="launcher", choices=("launcher", "forward"),
                        help="through its declared launcher, or its forward (real output memory)")
    args = parser.parse_args(argv)
    case = case_from_dict(json.loads(args.case))
    if not isinstance(case, HugeCase):
        parser.error(f"--case must describe a HugeCase, got {type(case).__name__}")
    result = run_huge_case(case, impl=args.impl, device=args.device, mode=args.mode)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
