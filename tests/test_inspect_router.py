"""scripts/inspect_router.py compiles the fused router's top-K kernel for sm_90 without a GPU and
says how its logits are laid over the warps: the fact docs/PERFORMANCE.md's router forms turn on
(every pick of the committed tiles crosses all their warps; 64 tokens on 4 warps keep a token's
row of experts within one warp, on wgmma)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("triton", reason="needs triton (the [triton] extra)")

from magi_moe.tests.developer_scripts import in_checkout, needs_nvidia_tools, run_script  # noqa: E402

pytestmark = in_checkout("inspect_router.py")


def _run(*args: str, interpret: bool = False):
    return run_script("inspect_router.py", *args, interpret=interpret)


@pytest.mark.slow  # two sm_90 compiles and a refused argument, 20-25 s on two cores
@needs_nvidia_tools()
def test_the_committed_picks_cross_every_warp_and_64_tokens_on_4_warps_do_not(tmp_path):
    out = tmp_path / "router.json"
    run = _run("--tiles", "{}", "--tiles", json.dumps({"block_s": 64, "warps": 4}),
               "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    committed, wide = json.loads(out.read_text())
    assert committed["tiles"]["block_s"] == 32 and committed["tiles"]["warps"] == 8
    assert committed["mma"] == "mma.sync"
    assert committed["warps_across_experts"] == 8 and committed["warps_along_tokens"] == 1
    assert committed["barriers"] > 0 and 0 < committed["shared_bytes"] <= 232448
    assert wide["mma"] == "wgmma"
    assert wide["warps_across_experts"] == 1 and wide["warps_along_tokens"] == 4
    for result in (committed, wide):
        assert result["registers"] is not None and result["registers"] <= 255
    bad = _run("--tiles", "{not json")
    assert bad.returncode == 2 and "--tiles must be JSON RoutingTiles fields" in bad.stderr


def test_it_refuses_to_run_under_the_interpreter():
    run = _run("--tiles", "{}", interpret=True)
    assert run.returncode != 0 and "unset TRITON_INTERPRET" in run.stderr
