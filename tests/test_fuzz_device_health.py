"""The device-health probe after every fuzz case (fuzz.record.set_health_probe): a case that
breaks the device's context while returning cleanly is named as the device fault, not the case
after it. On the CPU the probe is injected (a flag the "broken" case sets stands in for a poisoned
CUDA context); on a GPU the real probe meets a real asynchronous device-side assert."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from magi_moe.fuzz import record as rec

CONTEXT = {"broken": False}


def _case(n: int) -> dict:
    return {"property": "differential", "impl": "reference", "backend": "cpu", "case": {"n": n}, "params": {}}


def _run(n: int, *, breaks_at: int) -> None:
    """Case ``breaks_at`` breaks the context and returns cleanly (an asynchronous fault); any
    later case meets the broken context with a CUDA error, as the next kernel launch would."""
    with rec.in_flight(_case(n)):
        if CONTEXT["broken"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if n == breaks_at:
            CONTEXT["broken"] = True


def _probe() -> None:
    if CONTEXT["broken"]:
        raise RuntimeError("CUDA error: device-side assert triggered")


@pytest.fixture(autouse=True)
def _fresh_context():
    CONTEXT["broken"] = False
    yield
    rec.set_health_probe(None)
    CONTEXT["broken"] = False


def _culprit(probe) -> int:
    rec.set_health_probe(probe)
    for n in range(4):
        try:
            _run(n, breaks_at=1)
        except rec.DeviceFault as fault:
            return fault.record["case"]["n"]
    raise AssertionError("no device fault at all")


def test_the_probe_names_the_case_that_broke_the_context():
    assert _culprit(_probe) == 1


def test_without_the_probe_the_next_case_is_blamed():
    """The control: what the probe is for (the wrong case is named without it)."""
    assert _culprit(None) == 2


def test_a_healthy_probe_changes_nothing():
    rec.set_health_probe(lambda: None)
    for n in range(3):
        _run(n, breaks_at=-1)
    with pytest.raises(rec.PropertyViolation):  # a wrong result stays a violation
        with rec.in_flight(_case(9)):
            raise ValueError("wrong values")


def test_the_probe_must_be_callable():
    with pytest.raises(TypeError, match="probe must be callable or None, got int"):
        rec.set_health_probe(3)


def test_a_campaign_worker_exits_with_the_culprit_in_its_flight_record(tmp_path):
    """In a campaign the worker exits at once (its context is poisoned) and leaves the record of
    the case that broke it for the runner."""
    script = textwrap.dedent(f"""
        from magi_moe.fuzz import record as rec
        from magi_moe.tests.test_fuzz_device_health import CONTEXT, _probe, _run
        rec.configure_flight_recorder({str(tmp_path / "inflight")!r}, exit_on_device_fault=True)
        rec.set_health_probe(_probe)
        for n in range(4):
            _run(n, breaks_at=1)
    """)
    from magi_moe.fuzz.huge import REPO_ROOT, child_env

    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=child_env("cpu"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == rec.DEVICE_FAULT_EXIT, proc.stderr[-2000:]
    left = [json.loads(p.read_text()) for p in (tmp_path / "inflight").glob("inflight-*.json")]
    assert [d["status"] for d in left] == ["device-fault"], left
    assert left[0]["record"]["case"]["n"] == 1 and "health probe" in left[0]["message"]


@pytest.mark.cuda
def test_the_cuda_probe_names_an_asynchronous_device_assert(cuda_device):
    """On a GPU: a case that launches an out-of-bounds gather and returns without synchronizing
    is the device fault (the assert surfaces in the probe, not in the next case)."""
    rec.cuda_health_probe()  # healthy first
    script = textwrap.dedent("""
        import torch
        from magi_moe.fuzz import record as rec
        rec.set_health_probe(rec.cuda_health_probe)
        case = {"property": "differential", "impl": "x", "backend": "cuda", "case": {"n": 0}, "params": {}}
        try:
            with rec.in_flight(case):
                torch.zeros(4, device="cuda")[torch.tensor([1 << 20], device="cuda")]  # no sync here
        except rec.DeviceFault as fault:
            print("CULPRIT", fault.record["case"]["n"])
    """)
    from magi_moe.fuzz.huge import REPO_ROOT, child_env

    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=child_env("cuda"),
                          capture_output=True, text=True, timeout=300)
    assert "CULPRIT 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
