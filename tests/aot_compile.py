"""Compile, for a GPU this machine does not have, every kernel the fused and native paths launch.

Triton's compiler and ``ptxas`` ship with the CPU wheel, so CI can build the exact launches of
the released shapes for Hopper (sm_90) and Ampere (sm_80) and check what a GPU would reject at
load time: a compile error (an fp32/bf16 operand mix, an unsupported layout) or more shared
memory than the GPU has (the H200 fuzz campaign found the native kernel asking 256 KiB at
Dh = 272). Nothing runs: each kernel object is swapped for :class:`AheadOfTime`, which binds the
launch's real arguments with Triton's own binder and compiles instead of launching.

Run as a child process without ``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit``):
``python tests/aot_compile.py`` prints one JSON line per compiled launch. Uses Triton internals
(``create_function_from_signature``, ``JITFunction._pack_args``): checked on Triton 3.9.
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import replace

import torch

SHARED_LIMIT = {90: 232448, 80: 101376}  # bytes per block: H200 opt-in; Ampere's smallest (sm_86)


class AheadOfTime:
    """Stands in for ``kernel`` in ``kernel[grid](...)``: compiles for ``target``, records."""

    def __init__(self, kernel, name: str, target, log: list):
        self.kernel, self.name, self.target, self.log = kernel, name, target, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.compiler import ASTSource, compile as triton_compile, make_backend
            from triton.runtime.jit import create_function_from_signature

            kernel, backend = self.kernel, make_backend(self.target)
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = kernel._pack_args(
                backend, kwargs, bound, specialization, options)
            compiled = triton_compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=self.target, options=options.__dict__)
            self.log.append({"kernel": self.name, "arch": self.target.arch,
                             "shared": compiled.metadata.shared,
                             "num_warps": compiled.metadata.num_warps,
                             "wgmma": compiled.asm["ptx"].count("wgmma.mma_async")})
        return launch


KERNELS = {  # module -> kernel names launched through module attributes
    "magi_moe.kernels.schedule": ("block_schedule_kernel",),
    "magi_moe.kernels.gate_up_down": ("gate_up_kernel", "down_kernel"),
    "magi_moe.kernels.topk_sum": ("topk_sum_kernel",),
    "magi_moe.kernels.expert_mlp": ("expert_mlp_tma_kernel",),
    "magi_moe.kernels.router": ("router_topk_kernel", "bank_prefix_kernel",
                                       "place_routes_kernel"),
    "magi_moe.kernels.native": ("native_expert_kernel",),
}


@contextmanager
def compiling_for(arch: int, log: list):
    """Every kernel launch inside compiles for ``sm_<arch>`` instead of running; descriptor
    variants are allowed (``tma_supported``) for sm_90."""
    import importlib

    from triton.backends.compiler import GPUTarget

    from magi_moe.kernels import device

    target = GPUTarget("cuda", arch, 32)
    saved = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, AheadOfTime(getattr(module, name), name, target, log))
    saved.append((device, "tma_supported", device.tma_supported))
    device.tma_supported = lambda _: arch >= 90
    # the input checks refuse CPU tensors outside the interpreter; here nothing runs on them
    for module_name in ("magi_moe.kernels.fused_inputs",):
        module = importlib.import_module(module_name)
        saved.append((module, "check_kernel_device", module.check_kernel_device))
        module.check_kernel_device = lambda name, value: None
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def main() -> int:
    from magi_moe.config import MoEConfig, preset
    from magi_moe.kernels import fused as F
    from magi_moe.kernels import tiles as T
    from magi_moe.kernels.router import fused_route
    from magi_moe.kernels.tiles import RoutingTiles
    from magi_moe.kernels.workspace import FusedWorkspace
    from magi_moe.kernels.native import NativeTiles, fit_shared_memory, launch_native
    from magi_moe.packed_weights import pack_expert_weights
    from magi_moe.problems import random_problem

    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"
    log: list = []
    cfg = preset("magi2-full")
    problem = random_problem(cfg, 96, seed=0)  # CPU tensors: only dtypes and alignment matter
    packed = pack_expert_weights(problem.weights)
    table = problem.table
    entry = T.load_device_entry("NVIDIA H200")
    classes = {tiles.fitted(cfg) for _, tiles in T.load_tile_table("NVIDIA H200")}
    routing = RoutingTiles(**entry["routing"]) if entry and "routing" in entry else RoutingTiles()

    def expert_launches(tiles):
        F.fused_forward(problem.x, table, packed, cfg, tiles=tiles,
                        workspace=FusedWorkspace("cpu"), check_bounds=False)

    with compiling_for(90, log):
        for tiles in sorted(classes, key=repr):       # the H200 tile table, every class,
            expert_launches(tiles)
            expert_launches(T.two_kernel_tiles(tiles, cfg))  # and its no-TMA fallback
        fused_route(problem.x, problem.gate, problem.bias, cfg, block_m=64,
                    workspace=FusedWorkspace("cpu"), tiles=routing)
        native_start = NativeTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
        for dtype, head_dim in ((torch.bfloat16, 256), (torch.bfloat16, 272), (torch.float32, 272)):
            c = MoEConfig(num_heads=1, head_dim=head_dim, num_experts=4, top_k=2,
                          intermediate_size=48, dtype=dtype)
            p = random_problem(c, 8, seed=1)
            tiles = fit_shared_memory(native_start, c, dtype.itemsize, SHARED_LIMIT[90])
            for det in (False, True):
                acc = torch.zeros((p.table.num_routes, head_dim) if det else tuple(p.x.shape))
                launch_native(p.x, p.table, p.weights, c, acc, deterministic=det, tiles=tiles)
        # negative control: the tiles the native kernel used before it fitted them (the H200
        # refused them with OutOfResources at Dh = 272): must show up as over the limit
        c = MoEConfig(num_heads=1, head_dim=272, num_experts=4, top_k=2, intermediate_size=48)
        p = random_problem(c, 8, seed=1)
        launch_native(p.x, p.table, p.weights, c, torch.zeros(tuple(p.x.shape)),
                      deterministic=False, tiles=native_start)
        log[-1]["control"] = "native tiles before fitting, Dh=272"
    with compiling_for(80, log):                      # any other CUDA GPU: the portable tiles
        expert_launches(T.PORTABLE_TILES.fitted(cfg))
        expert_launches(replace(T.PORTABLE_TILES, gu_variant="mlp_tma").fitted(cfg))  # falls back
    for entry in log:
        print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
