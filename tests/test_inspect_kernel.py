"""scripts/inspect_kernel.py compiles the one-kernel path for sm_90 without a GPU and finds its
loop over I: the tool that screens kernel changes before GPU time (docs/PERFORMANCE.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="needs triton (the [triton] extra)")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "inspect_kernel.py"
NVIDIA_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# The installed suite (magi_moe.tests) has no scripts/: this is a checkout's developer tool.
pytestmark = pytest.mark.skipif(not SCRIPT.exists(),
                                reason="scripts/inspect_kernel.py is in a checkout, not the wheel")


def _run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


needs_tools = pytest.mark.skipif(not (NVIDIA_TOOLS / "nvdisasm").exists(),
                                 reason="this Triton ships no NVIDIA tools (nvdisasm, ptxas)")


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
