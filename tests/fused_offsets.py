"""Every kernel of the fused layer addressed past ``token * row_stride = 2^31``, cheaply enough for
the CPU suite (tests/test_fused_offsets.py runs this module in child processes).

The product a kernel forms is ``token * row_stride``; the released layer reaches 2^31 with 700,100
tokens of stride 3072, which the interpreter cannot run through the router or the top-k sum (both
launch a program per block of *all* tokens). Here the row stride is large instead: ``x`` and
``out`` are row views ``ROW_STRIDE`` elements apart into lazily allocated buffers (about 4.3 GB of
address space each, as the 700,100-token input, a few pages touched), so three tokens suffice and
token 2 lies past 2^31. ``ROW_STRIDE`` itself fits in int32, so a kernel that forms the product in
int32 wraps: it reads a wild address (SIGSEGV), or other rows. The layer on these views must give,
bit for bit, what it gives on the same three rows stored contiguously, and write nothing beside the
rows of ``out``.

Each plan the interpreter can run is checked: ``fused_layer_forward`` itself, the pointer kernels
(``router_topk_kernel``, ``gate_up_kernel``, ``down_kernel``, ``topk_sum_kernel``) and the
one-kernel path (``expert_mlp_tma_kernel``, which reads ``x`` through ``blocks.block_x_rows``).

``python -m magi_moe.tests.fused_offsets [--mutant NAME]`` (``TRITON_INTERPRET=1``) prints one
``OK``/``WRONG`` line per plan and exits 0 when all are right, :data:`WRONG_EXIT` otherwise;
``--mutant`` first plants one int32 offset (:data:`MUTANTS`) in a copy of the kernel's module.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch

WRONG_EXIT = 3
ROW_STRIDE = 2**30 + 64  # fits int32; token 2's row starts past 2^31 elements
NUM_TOKENS = 3
PAST_BOUNDARY = [t for t in range(NUM_TOKENS) if t * ROW_STRIDE >= 2**31]

# (name, module, kernel source text, the same with an int32 offset, modules to patch)
MUTANTS = {
    "router-x-read": ("magi_moe.kernels.router",
                      "x_ptrs = x_ptr + s[:, None] * stride_x",
                      "x_ptrs = x_ptr + s.to(tl.int32)[:, None] * stride_x",
                      "router_topk_kernel", ("magi_moe.kernels.router",)),
    "topk-sum-output": ("magi_moe.kernels.topk_sum",
                        "tl.store(out_ptr + token[:, None] * stride_out",
                        "tl.store(out_ptr + token.to(tl.int32)[:, None] * stride_out",
                        "topk_sum_kernel", ("magi_moe.kernels.topk_sum",)),
    "gate-up-x-read": ("magi_moe.kernels.gate_up_down",
                       "tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)",
                       "tokens = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int32)",
                       "gate_up_kernel", ("magi_moe.kernels.gate_up_down",)),
    "mlp-x-read": ("magi_moe.kernels.blocks",
                   "return tl.load(x_ptr + tokens[:, None] * stride_x",
                   "return tl.load(x_ptr + tokens.to(tl.int32)[:, None] * stride_x",
                   "block_x_rows", ("magi_moe.kernels.expert_mlp",)),
}

# The plans checked: the tiles' variant fields, and the kernels the plan must launch
# ("layer": fused_layer_forward itself, on the tiles it chooses).
PLANS = {
    "layer": (None, ()),
    "pointer": ({}, ("gate_up_kernel", "down_kernel", "topk_sum_kernel")),
    "mlp-tma": (dict(gu_variant="mlp_tma", gu_block_n=16), ("expert_mlp_tma_kernel", "topk_sum_kernel")),
}


def plant(name: str, workdir: Path) -> None:
    """Load a copy of the mutant's module with its one change and put its kernel in place."""
    module_name, original, mutated, attr, into = MUTANTS[name]
    source = Path(importlib.import_module(module_name).__file__).read_text()
    if source.count(original) != 1:
        raise AssertionError(f"mutant {name}: {original!r} is not in {module_name} exactly once")
    package = module_name.rsplit(".", 1)[0]
    source = source.replace(original, mutated).replace("from ..", "from magi_moe.")
    source = re.sub(r"^from \.(\w)", rf"from {package}.\1", source, flags=re.M)
    source = re.sub(r"^from \. import", f"from {package} import", source, flags=re.M)
    path = workdir / f"mutant_{name.replace('-', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton's jit looks the module up for the kernel's globals
    spec.loader.exec_module(module)
    for target in into:
        setattr(importlib.import_module(target), attr, getattr(module, attr))


def strided_rows(rows: torch.Tensor, fill: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A lazily allocated buffer and a view of it: ``rows``' shape, rows ``ROW_STRIDE`` apart.
    Only the rows and their two neighbouring elements are written (``fill`` or ``rows``)."""
    S, D = rows.shape
    base = torch.empty((S - 1) * ROW_STRIDE + D + 1, dtype=rows.dtype)
    view = base.as_strided((S, D), (ROW_STRIDE, 1))
    if fill is None:
        view.copy_(rows)
    else:
        view.fill_(fill)
    return base, view


def guards(base: torch.Tensor, D: int) -> torch.Tensor:
    """The element just after each row and just before each row but the first."""
    after = torch.arange(NUM_TOKENS) * ROW_STRIDE + D
    before = torch.arange(1, NUM_TOKENS) * ROW_STRIDE - 1
    return torch.cat([after, before])


def run_layer(x, problem, tiles, out, want_kernels):
    """The fused layer's two halves as ``fused_layer_forward`` runs them, on given tiles
    (``None``: ``fused_layer_forward`` itself); returns the routes (for the router's own check)."""
    from magi_moe.kernels.fused import fused_call, run_plan
    from magi_moe.kernels.fused_layer import fused_layer_forward
    from magi_moe.kernels.router import fused_route
    from magi_moe.kernels.workspace import FusedWorkspace

    cfg, ws = problem.config, FusedWorkspace(x.device)
    if tiles is None:
        fused_layer_forward(x, problem.gate, problem.bias, problem.weights, cfg, out=out, workspace=ws)
        return None
    routes = fused_route(x, problem.gate, problem.bias, cfg, block_m=tiles.block_m, workspace=ws)
    plan, call = fused_call(x, routes.table, problem.weights, cfg, out=out, tiles=tiles,
                            workspace=ws, schedule=routes.schedule, check_bounds=False)
    missing = [k for k in want_kernels if k not in plan.kernels]
    if missing:
        raise AssertionError(f"the plan {plan.kernels} does not launch {missing} ({plan.reasons})")
    run_plan(plan, call)
    return routes.expert_ids.clone(), routes.probs.clone()


def check_plan(name: str) -> str | None:
    """None when the layer on the strided views is the layer on contiguous rows, else why not."""
    from magi_moe.config import MoEConfig
    from magi_moe.kernels.tiles import INTERPRETER_TILES, FusedTiles
    from magi_moe.problems import random_problem

    variant, kernels = PLANS[name]
    cfg = MoEConfig(num_heads=2, head_dim=32, num_experts=4, top_k=2, intermediate_size=64)
    problem = random_problem(cfg, NUM_TOKENS, seed=7)
    tiles = None if variant is None else FusedTiles(**{**vars(INTERPRETER_TILES), **variant}).fitted(cfg)
    want = torch.full_like(problem.x, float("nan"))
    want_routes = run_layer(problem.x, problem, tiles, want, kernels)
    _, x = strided_rows(problem.x)
    out_base, out = strided_rows(problem.x, fill=float("nan"))
    g = guards(out_base, cfg.hidden_size)
    out_base[g] = float("nan")
    got_routes = run_layer(x, problem, tiles, out, kernels)
    if got_routes is not None and not (torch.equal(got_routes[0], want_routes[0])
                                       and torch.equal(got_routes[1], want_routes[1])):
        bad = sorted({int(t) for t in (got_routes[0] != want_routes[0]).nonzero()[:, 0]})
        return f"the router chose other experts or probabilities (tokens {bad}, past 2^31: {PAST_BOUNDARY})"
    wrong = [t for t in range(NUM_TOKENS) if not torch.equal(out[t], want[t])]
    if wrong:
        return f"output rows {wrong} differ from the contiguous run (past 2^31: {PAST_BOUNDARY})"
    if not bool(torch.isnan(out_base[g]).all()):
        return "a write landed beside the rows of out"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutant", choices=sorted(MUTANTS))
    parser.add_argument("--plan", action="append", choices=sorted(PLANS),
                        help="the plans to check (default: all)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.mutant:
            plant(args.mutant, Path(tmp))
        wrong = 0
        for name in args.plan or PLANS:
            why = check_plan(name)
            print(f"WRONG {name}: {why}" if why else f"OK {name}", flush=True)
            wrong += why is not None
    return WRONG_EXIT if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
