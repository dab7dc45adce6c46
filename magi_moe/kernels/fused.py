"""The fused BF16 path's expert computation on a route table: a grouped GEMM over padded
per-expert row blocks, no atomics, and nothing sized by a count read back to the host.

:func:`fused_call` checks the inputs, plans the launches (:mod:`.plan`, which says why it took
any fallback) and takes the buffers; :func:`run_plan` launches the plan's steps, each by the
launcher it carries, defined beside its kernel:

1. ``block_schedule_kernel`` (:mod:`.schedule`, with a worked example): from the CSR offsets,
   the blocks of ``BLOCK_M`` routes of every bank ``f = h*E + e``, written into an upper-bound
   buffer, and the live block count into a one-element device buffer.
2. the expert step: on Hopper, as the tile table asks, ``expert_mlp_tma_kernel``
   (:mod:`.expert_mlp`): gate/up, SwiGLU7 and down of a row block in one work item; elsewhere,
   or where it cannot run, ``gate_up_kernel`` then ``down_kernel`` (:mod:`.gate_up_down`) with
   the activation, rounded to bf16 at the same point, in a buffer between them. Either writes
   one fp32 row per route ``p * expert(x)`` in CSR order ``[R, Dh]`` and where each
   ``(s, h, k)`` slot's row went (``slot_route [S*H*K]``, int32).
3. ``topk_sum_kernel`` (:mod:`.topk_sum`): ``y[s, h] = sum_k row(s, h, k)`` in fp32 in fixed
   order, rounded once to the output dtype.

The GEMM kernels are persistent: the host launches enough programs to fill the GPU, and
each loops over work items ``program_id, program_id + num_programs, ...`` below the live
count read from device memory. A grid of the upper bound would have launched up to
``min(H*E, R) * tiles`` programs with nothing to do, each holding a multiprocessor's shared
memory while it starts and exits.

Every output element is written by exactly one program and every sum has a fixed order, so
the result is bitwise identical run after run: deterministic mode costs nothing.

Offsets: every ``index * stride`` product is formed in int64 (token, route, padded row, bank),
so inputs past ``token * row_stride = 2^31`` are addressed correctly.

Interpreter (``TRITON_INTERPRET=1``): ``tl.dot`` on bf16 operands is wrong there (CONTRACT 8), so
``UPCAST`` converts operands to fp32 before each dot (bf16 x bf16 products are exact in fp32)
and uses "ieee" dots; its fp32 -> bf16 cast truncates, so the two roundings are done by bit
arithmetic there (``rounding.round_to``).
"""
from __future__ import annotations

import torch

from ..config import MoEConfig
from ..routing import RouteTable
from ..validation import check_out, check_unit_last_stride
from ..weights import ExpertWeights
from .device import device_facts
from .expert_mlp import compiled_shared_memory
from .fused_inputs import FUSED_DTYPES, check_fused_inputs  # noqa: F401 (FUSED_DTYPES: re-exported)
from .fused_prepare import expert_buffers
from .launch_steps import FusedCall
from .plan import LaunchPlan, plan_fused
from .schedule import BlockSchedule, max_blocks, schedule_buffers
from .tiles import INTERPRETER_TILES, FusedTiles, choose_fused_tiles
from .workspace import FusedWorkspace


def run_plan(plan: LaunchPlan, call: FusedCall) -> None:
    """Launch ``plan``'s steps in order on ``call``'s tensors and descriptors, each by its
    step's launcher; nothing is decided or taken here."""
    if plan.clear_slots:  # a partial (hand-built) table leaves slots without a route
        call.slot_route.fill_(-1)
    for step in plan.steps:
        step.launcher.launch(step, call)


def _plan_call(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
               tiles: FusedTiles, *, schedule_built: bool, rows_only: bool = False) -> LaunchPlan:
    """The plan :func:`fused_call` and :func:`launch_route_rows` run: this device's facts,
    and on a GPU the compiled one-kernel path's shared memory."""
    return plan_fused(config, table.num_tokens, table.num_routes, tiles, device_facts(x.device),
                      weights, schedule_built=schedule_built, rows_only=rows_only,
                      shared_memory_of=compiled_shared_memory(weights, config)
                      if x.device.type == "cuda" else None)


def _check_schedule(schedule: BlockSchedule, table: RouteTable, config: MoEConfig,
                    tiles: FusedTiles) -> None:
    """A schedule built already must fit the table and the tiles."""
    R = table.num_routes
    if schedule.block_m != tiles.block_m:
        raise ValueError(f"schedule was built for block_m={schedule.block_m}, "
                         f"tiles use {tiles.block_m}")
    want = max_blocks(R, config.num_banks, tiles.block_m)
    if schedule.max_blocks != want:
        raise ValueError(f"schedule has {schedule.max_blocks} blocks; a table of {R} routes over "
                         f"{config.num_banks} banks needs {want}")


def launch_route_rows(x: torch.Tensor, table: RouteTable, weights: ExpertWeights,
                      config: MoEConfig, rows: torch.Tensor, slot_route: torch.Tensor, *,
                      tiles: FusedTiles, workspace: FusedWorkspace,
                      schedule: BlockSchedule | None = None) -> LaunchPlan:
    """Expert rows only: fp32 ``p * expert(x)`` into caller-owned ``rows`` ``[R, Dh]`` (CSR
    order, as the native kernel's deterministic rows) and each route's CSR index into
    ``slot_route`` ``[S*H*K]`` int32. Huge-input tests call this with lazily allocated buffers.
    Returns the plan it ran."""
    R = table.num_routes
    if schedule is not None and R:
        _check_schedule(schedule, table, config, tiles)
    plan = _plan_call(x, table, weights, config, tiles, schedule_built=schedule is not None,
                      rows_only=True)
    b = expert_buffers(workspace, x.device, plan, weights, config, table.num_tokens, R, x.dtype,
                       rows=rows, slot_route=slot_route)
    if R and schedule is None:
        schedule = schedule_buffers(workspace, R, config.num_banks, tiles.block_m)
    run_plan(plan, FusedCall(x, table, weights, config, workspace, schedule if R else None, rows,
                             slot_route, None, b.act, b.descriptors))
    return plan


def fused_call(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
               *, out: torch.Tensor | None = None, tiles: FusedTiles | None = None,
               workspace: FusedWorkspace | None = None,
               schedule: BlockSchedule | None = None,
               check_bounds: bool | None = None) -> tuple[LaunchPlan, FusedCall]:
    """What :func:`fused_forward` runs: its inputs checked, its plan made, its buffers taken
    from the workspace (:func:`~.fused_prepare.expert_buffers`); nothing launched. An empty
    input gets an empty plan."""
    check_fused_inputs(x, table, weights, config, check_bounds=check_bounds)
    S, D = x.shape
    if out is None:
        out = torch.empty(S, D, dtype=x.dtype, device=x.device)
    else:
        check_out(out, x)
        check_unit_last_stride("out", out)
    if S == 0:  # nothing to launch: the empty out stands in for the buffers no step reads
        return LaunchPlan((), tiles or INTERPRETER_TILES, device_facts(x.device), 0), FusedCall(
            x, table, weights, config, workspace, None, out, out, out)
    R = table.num_routes
    tiles = tiles or choose_fused_tiles(config, R, x.device)
    if schedule is not None and R:
        _check_schedule(schedule, table, config, tiles)
    plan = _plan_call(x, table, weights, config, tiles, schedule_built=schedule is not None)
    b = expert_buffers(workspace, x.device, plan, weights, config, S, R, x.dtype)
    if R and schedule is None:
        schedule = schedule_buffers(b.workspace, R, config.num_banks, tiles.block_m)
    return plan, FusedCall(x, table, weights, config, b.workspace, schedule if R else None,
                           b.rows, b.slot_route, out, b.act, b.descriptors)


def fused_forward(x: torch.Tensor, table: RouteTable, weights: ExpertWeights, config: MoEConfig,
                  *, out: torch.Tensor | None = None, tiles: FusedTiles | None = None,
                  workspace: FusedWorkspace | None = None,
                  schedule: BlockSchedule | None = None,
                  check_bounds: bool | None = None) -> torch.Tensor:
    """The expert computation on ``table``'s routes; returns ``out`` ``[S, H*Dh]`` in ``x.dtype``.

    For a table magi-moe built itself and nobody changed since (``table.trusted``: the fused
    router, ``build_route_table``), no host synchronisation, and once the workspace has grown to
    the problem's size, no allocation. Any other table is validated first (one sync), so a bad
    hand-built or edited table gets a clear error instead of a wild memory access or a wrong
    sum; ``check_bounds`` overrides. ``schedule``: a block schedule already built on the device
    (the fused router builds it with the route table); built here otherwise. Which kernels
    run: :func:`fused_call`'s plan (:mod:`.plan`)."""
    plan, call = fused_call(x, table, weights, config, out=out, tiles=tiles, workspace=workspace,
                            schedule=schedule, check_bounds=check_bounds)
    run_plan(plan, call)
    return call.out
