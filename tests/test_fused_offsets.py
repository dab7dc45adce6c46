"""int64 offsets in every kernel of the fused layer, on the CPU (CONTRACT sections 7, 8).

The router's read of ``x``, the expert kernels' reads of ``x`` (pointer and
one-kernel plans) and the top-k sum's write of ``y`` each form ``token * row_stride``; the layer
on rows ``2^30 + 64`` elements apart (tests/fused_offsets.py: token 2 past 2^31, lazily
allocated) must give the bits it gives on contiguous rows. Negative controls: an int32 offset
planted in each kernel, one at a time, must make that check fail (a wild read that kills the
child, or other rows). Each runs in a child process under its own memory cap (fuzz.child), a
few seconds under the interpreter."""
from __future__ import annotations

import sys

import pytest

from magi_moe.backends import BACKENDS
from magi_moe.fuzz.child import run_capped
from magi_moe.fuzz.huge import REPO_ROOT, child_env
from magi_moe.tests.fused_offsets import MUTANTS, PLANS, WRONG_EXIT

pytestmark = pytest.mark.interpret


def run_check(*args: str):
    why = BACKENDS["interpret"].unavailable_reason()
    if why:
        pytest.skip(f"backend interpret unavailable: {why}")
    return run_capped([sys.executable, "-m", "magi_moe.tests.fused_offsets", *args],
                      env=child_env("interpret"), cwd=REPO_ROOT, timeout=300)


def test_every_fused_kernel_addresses_rows_past_2_31():
    run = run_check()
    assert (run.end.kind, run.returncode) == ("exited", 0), (run.end, run.stdout, run.stderr[-2000:])
    assert run.stdout.split("\n")[:-1] == [f"OK {name}" for name in PLANS]


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_an_int32_offset_planted_in_a_fused_kernel_is_caught(mutant):
    """The check above, with ``token * row_stride`` formed in int32 in one kernel: the child
    reads or writes a wild address (SIGSEGV), or the plans that run that kernel give other rows."""
    run = run_check("--mutant", mutant)
    if run.end.kind == "wild_read":
        return
    assert (run.end.kind, run.returncode) == ("exited", WRONG_EXIT), \
        f"{mutant} was not caught ({run.end.text}):\n{run.stdout}{run.stderr[-2000:]}"
    assert "WRONG" in run.stdout and "past 2^31: [2]" in run.stdout, run.stdout
