"""scripts/inspect_kernel.py compiles the one-kernel path for sm_90 without a GPU and finds its
loop over I: the tool that screens kernel changes before GPU time (docs/PERFORMANCE.md)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")

from magi_moe.tests.developer_scripts import in_checkout, needs_nvidia_tools, run_script  # noqa: E402

pytestmark = in_checkout("inspect_kernel.py")


def _run(*args: str, interpret: bool = False):
    return run_script("inspect_kernel.py", *args, interpret=interpret)


needs_tools = needs_nvidia_tools()


def _inner_loop(tmp_path, **tiles) -> dict:
    out = tmp_path / "inspect.json"
    run = _run("--tiles", json.dumps({"block_m": 64, "gu_block_n": 16, "gu_warps": 4,
                                      "gu_stages": 3, **tiles}), "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    (result,) = json.loads(out.read_text())
    assert 0 < result["shared_bytes"] <= 232448 and result["registers"] <= 255
    assert result["inner_loop"] is not None, "no loop issuing HGMMAs was found"
    return result["inner_loop"]


@needs_tools
def test_the_plain_one_kernel_loop_is_one_warpgroup_of_mmas_without_spills(tmp_path):
    """BM=64, 16-wide slices, 4 warps: each trip of the loop over I is the gate and up dots over
    Dh=256 in 16-deep MMAs (16 each) and one down MMA: 33 HGMMAs, no local-memory traffic.
    With x in shared memory only the down MMA (the activation) takes a register operand."""
    loop = _inner_loop(tmp_path)
    assert loop["hgmma"] == 2 * 256 // 16 + 16 // 16
    assert (loop["spill_stores"], loop["spill_loads"]) == (0, 0)
    assert loop["hgmma_register_a"] == 1


def test_it_refuses_to_run_under_the_interpreter():
    run = _run("--tiles", "{}", interpret=True)
    assert run.returncode != 0 and "unset TRITON_INTERPRET" in run.stderr


def test_bad_tiles_are_named():
    run = _run("--tiles", '{"block_m": 48}')
    assert run.returncode == 2 and "--tiles must be JSON FusedTiles fields" in run.stderr
