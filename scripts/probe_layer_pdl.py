"""Probe: the fused layer's launches with programmatic dependent launch (Hopper's
``griddepcontrol``), against the committed launches, in one run.

With the launch attribute a kernel's programs may be placed on the SMs before the kernel ahead of
it in the stream has finished; each then waits (``gdc_wait``) before its first read, so the
outputs cannot change, and the launch gap between two kernels is hidden. Three forms of every
launch of the layer and of its kernel (schedule, expert step, top-K sum):

- ``committed``: as shipped;
- ``pdl``: each kernel waits first thing, launched with ``launch_pdl=True``;
- ``pdl-early``: the same, and each kernel lets the next one launch right after its wait
  (``gdc_launch_dependents``), so the next kernel's programs take SMs as this one's free them.

The kernels are patched in this process only (their source with the two calls put first, as a
new JIT function); the shipped ones are untouched. Every form's outputs are compared bit for bit
with the committed ones; times are CUDA events, L2 flushed before each call, median of 60.

    python scripts/probe_layer_pdl.py
"""
from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from magi_moe.bench.cases import BenchCase, draw_problem  # noqa: E402
from magi_moe.bench.kernel_level import KernelLevel  # noqa: E402
from magi_moe.bench.timing import summarize, time_paths  # noqa: E402
from magi_moe.kernels import fused as F  # noqa: E402
from magi_moe.kernels import fused_routing as FR  # noqa: E402
from magi_moe.kernels import fused_tma as T  # noqa: E402
from magi_moe.kernels import schedule as SC  # noqa: E402
from magi_moe.problems import same_bits  # noqa: E402

# (module, name) of every kernel the layer launches, in launch order
LAUNCHES = [(FR, "router_topk_kernel"), (FR, "bank_prefix_kernel"),
            (SC, "block_schedule_kernel"), (FR, "place_routes_kernel"),
            (T, "expert_mlp_tma_kernel"), (F, "topk_sum_kernel")]


def with_calls_first(kernel: triton.JITFunction, calls: list[str]) -> triton.JITFunction:
    """A new JIT function of ``kernel``'s source with ``calls`` as its first statements."""
    src = textwrap.dedent(kernel.src)
    fn_def = ast.parse(src).body[0]
    body = fn_def.body
    first = body[1] if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str) and len(body) > 1) else body[0]
    lines = src.splitlines()
    indent = lines[first.lineno - 1][:first.col_offset]
    inserted = [indent + c for c in calls]
    patched = "\n".join(lines[:first.lineno - 1] + inserted + lines[first.lineno - 1:]) + "\n"
    new = triton.JITFunction(kernel.fn)
    new._unsafe_update_src(patched)
    return new


class PDLLaunch:
    """``kernel[grid](...)`` and ``kernel.warmup(...)`` with ``launch_pdl=True`` added."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kw: launch(*args, launch_pdl=True, **kw)

    def warmup(self, *args, **kw):
        return self.kernel.warmup(*args, launch_pdl=True, **kw)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


COMMITTED = {(m, n): getattr(m, n) for m, n in LAUNCHES}
FORMS = {
    "committed": None,
    "pdl": ["tl.extra.cuda.gdc_wait()"],
    "pdl-early": ["tl.extra.cuda.gdc_wait()",
                  "tl.extra.cuda.gdc_launch_dependents()"],
}
PATCHED = {form: {key: PDLLaunch(with_calls_first(k, calls)) for key, k in COMMITTED.items()}
           for form, calls in FORMS.items() if calls}


def use(form: str) -> None:
    for (module, name), kernel in COMMITTED.items():
        setattr(module, name, kernel if form == "committed" else PATCHED[form][(module, name)])


def main():
    from magi_moe.kernels.fused_layer import fused_layer_forward
    from magi_moe.kernels.workspace import FusedWorkspace
    device = torch.device("cuda")
    for H, S in [(3, 512), (3, 4096), (3, 16384), (12, 4096)]:
        problem = draw_problem(BenchCase(H, S), device)
        cfg, x = problem.config, problem.x
        level = KernelLevel.of(problem)
        packed, tiles = level.packed, level.tiles()
        paths, outs = {}, {}
        for form in FORMS:
            ws, out_k, out_l = FusedWorkspace(device), torch.empty_like(x), torch.empty_like(x)

            def whole(form=form, ws=ws, out=out_k):
                use(form)
                F.fused_forward(x, problem.table, packed, cfg, out=out, tiles=tiles, workspace=ws)

            def layer(form=form, ws=ws, out=out_l):
                use(form)
                fused_layer_forward(x, problem.gate, problem.bias, packed, cfg, out=out,
                                    workspace=ws)
            outs[form] = (out_k, out_l)
            for fn in (whole, layer):
                fn()
            torch.cuda.synchronize()
            paths[f"whole {form}"], paths[f"layer {form}"] = whole, layer
        for out_k, out_l in outs.values():  # poison, then one call of each: unwritten rows show
            out_k.fill_(float("nan"))
            out_l.fill_(float("nan"))
        for fn in paths.values():
            fn()
        torch.cuda.synchronize()
        base_k, base_l = outs["committed"]
        times = time_paths(paths, warmup=10, iters=60, flush_mib=512, device=device)
        med = {n: summarize(t)["median_ms"] * 1000 for n, t in times.items()}
        for form, (out_k, out_l) in outs.items():
            same = same_bits(out_k, base_k) and same_bits(out_l, base_l)
            w, l_ = med[f"whole {form}"], med[f"layer {form}"]
            print(f"H={H} S={S} {form}: whole {w:.1f} us, layer {l_:.1f} us, "
                  f"layer - whole {l_ - w:.1f} us, layer / whole {l_ / w:.3f}, "
                  f"bits {'same' if same else 'DIFFER'}", flush=True)
        use("committed")


if __name__ == "__main__":
    main()
