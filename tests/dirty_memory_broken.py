"""A broken outside implementation whose bug only used memory shows (tests/test_dirty_memory.py):

* :data:`UNZEROED_EMPTY_EXPERT`: sums each head's output over a dense per-expert buffer
  ``[H*E, S, Dh]`` carved from a ``torch.empty`` arena, and zeroes only the experts that got
  tokens. An expert with no tokens adds whatever the arena held: nothing on fresh memory (a
  64 MiB arena is freshly mapped, zeroed pages on the CPU), garbage from the second step of a
  real run on. Right on every fresh-memory test; the harness's used memory catches it.

Not registered; tests name it ``magi_moe.tests.dirty_memory_broken:UNZEROED_EMPTY_EXPERT``.
"""
from __future__ import annotations

import torch

from magi_moe.implementation import Implementation

from .outside_broken_kernels import _route_rows

# The arena is at least this many fp32 elements (64 MiB): above glibc's largest mmap threshold,
# so on the CPU it is fresh zeroed pages unless the harness hands used memory.
ARENA_ELEMENTS = 16 << 20


def _unzeroed_forward(x, table, weights, config, *, out):
    H, E, Dh = config.num_heads, config.num_experts, config.head_dim
    S = x.shape[0]
    arena = torch.empty(max(H * E * S * Dh, ARENA_ELEMENTS), dtype=torch.float32, device=x.device)
    per_expert = arena[:H * E * S * Dh].view(H * E, S, Dh)
    offsets = table.gather_ids.long() * config.hidden_size
    contrib, bank = _route_rows(x, table, weights, config, offsets)
    per_expert[table.counts() > 0] = 0.0  # the bug: experts without tokens keep the arena's bytes
    per_expert.index_put_((bank, table.gather_ids.long()), contrib, accumulate=True)
    heads = per_expert.view(H, E, S, Dh).sum(1)  # [H, S, Dh]
    return out.copy_(heads.permute(1, 0, 2).reshape(S, H * Dh))


UNZEROED_EMPTY_EXPERT = Implementation(
    name="outside-unzeroed-empty-expert", forward=_unzeroed_forward, backends=("cpu", "cuda"),
    precision="bf16-fp32acc-atomic", dtypes=(torch.bfloat16,),
    description="BROKEN on purpose: experts without tokens add the uninitialised arena")
