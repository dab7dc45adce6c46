"""Every kernel launch of the fused and native paths at the released shapes compiles for Hopper
(sm_90, with the H200 tile table) and Ampere (sm_80, the portable tiles) and fits the GPU's
shared memory: checked on the CPU with Triton's own compiler and ptxas (``tests/aot_compile.py``,
in a child process without the interpreter). This is what a GPU would refuse at load time,
caught without one; a negative control shows the check sees the native kernel's old Dh = 272
tiles as too big, the failure the H200 fuzz campaign found."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from magi_moe.tests.aot_compile import SHARED_LIMIT  # noqa: E402

pytestmark = pytest.mark.slow  # 40-100 s of compiling on two cores, and 12 GB in the child

ROOT = Path(__file__).resolve().parents[1]
EXPERT_GEMMS = {"gate_up_kernel", "down_kernel", "expert_mlp_tma_kernel"}


@pytest.fixture(scope="module")
def launches() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences a warning)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_compile.py")], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    if proc.returncode != 0 and "create_function_from_signature" in proc.stderr:
        pytest.skip("this Triton's internals differ from the ones aot_compile.py binds with")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_launch_compiles_and_fits_shared_memory(launches):
    regular = [e for e in launches if "control" not in e]
    kernels = {e["kernel"] for e in regular if e["arch"] == 90}
    assert EXPERT_GEMMS | {"topk_sum_kernel", "block_schedule_kernel",
                           "router_topk_kernel", "bank_prefix_kernel", "place_routes_kernel",
                           "native_expert_kernel"} <= kernels
    over = [e for e in regular if e["shared"] > SHARED_LIMIT[e["arch"]]]
    assert not over, over


def test_hopper_expert_gemms_use_wgmma(launches):
    """A silent fallback from Hopper's warpgroup MMA would cost about half the speed."""
    gemms = [e for e in launches if e["arch"] == 90 and e["kernel"] in EXPERT_GEMMS]
    assert gemms and all(e["wgmma"] > 0 for e in gemms), gemms


def test_negative_control_is_over_the_limit(launches):
    control = [e for e in launches if "control" in e]
    assert len(control) == 1 and control[0]["shared"] > SHARED_LIMIT[90], control
