"""Implementations magi-moe did not write: named on the command line, found as entry points,
held to the protocol of magi_moe.registry, and reported under their own names.

The ``test_protocol_*`` tests take ``impl_backend``, so they run for whatever ``--impl`` selects;
one test runs them in a child pytest with ``--impl magi_moe.tests.outside_impl_example:IMPL`` and an
entry-point plugin, the way a kernel team would, and reads the JUnit report.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from magi_moe import plugins, registry
from magi_moe.judge import judge
from magi_moe.config import preset
from magi_moe.problems import random_problem, run_poisoned
from magi_moe.registry import get_implementation, implementations, load_implementation
from magi_moe.routing import validate_route_table

REPO = Path(__file__).resolve().parent.parent
SPEC = "magi_moe.tests.outside_impl_example:IMPL"


@pytest.fixture(autouse=True)
def _restore_registry(monkeypatch):
    """Implementations loaded by a test do not outlive it (the process registry is global)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(plugins, "_loaded", dict(plugins._loaded))


def _write_distribution(root: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str]) -> Path:
    """An installed-looking distribution under ``root`` (a ``.dist-info`` next to its modules)."""
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\n{lines}")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return root


PLUGIN_MODULE = """
    import torch
    from magi_moe.registry import Implementation

    def make():  # a factory: heavy imports wait until the implementation is asked for
        from magi_moe.tests.outside_impl_example import einsum_forward
        return Implementation("einsum-plugin", einsum_forward, ("cpu",), "bf16-fp32acc",
                              capabilities={"deterministic"}, description="entry-point demo")
"""
BROKEN_MODULE = """
    from magi_moe.registry import Implementation
    from magi_moe.tests.outside_impl_example import einsum_forward

    WRONG_NAME = Implementation("not-my-entry-point-name", einsum_forward, ("cpu",), "bf16-fp32acc")
    CLASH = Implementation("native", einsum_forward, ("cpu",), "bf16-fp32acc")
    NOT_AN_IMPL = 42
"""


@pytest.fixture
def plugin_dir(tmp_path) -> Path:
    return _write_distribution(tmp_path / "good", "magi_demo_plugin", {"magi_demo_plugin": PLUGIN_MODULE},
                               {"einsum-plugin": "magi_demo_plugin:make"})


@pytest.fixture
def broken_dir(tmp_path) -> Path:
    modules = {"magi_broken_plugins": BROKEN_MODULE}
    return _write_distribution(tmp_path / "broken", "magi_broken_plugins", modules, {
        "demo-wrong-name": "magi_broken_plugins:WRONG_NAME",
        "demo-not-an-impl": "magi_broken_plugins:NOT_AN_IMPL",
        "demo-missing-module": "magi_no_such_module:IMPL",
    })


# -- the protocol, for whatever --impl selects --------------------------------------------------

@pytest.mark.clause("accuracy")
def test_protocol_matches_the_oracle(impl_backend, impl_dtype):
    """At every dtype the implementation declares."""
    problem = random_problem(impl_backend.impl.fit(preset("small"), impl_dtype), 57, seed=31,
                             device=impl_backend.device)
    out = run_poisoned(impl_backend.impl, problem)
    assert out.dtype == impl_backend.impl.output_dtype(impl_dtype)
    v = judge(out, problem, impl_backend.impl)
    assert v.ok, v.text


@pytest.mark.clause("zero-rows")
def test_protocol_writes_zeros_where_nothing_is_routed(impl_backend):
    cfg = impl_backend.impl.fit(preset("tiny"))
    full = random_problem(cfg, 40, seed=32, device=impl_backend.device)
    gen = torch.Generator().manual_seed(32)
    keep = (torch.rand(full.table.num_routes, generator=gen) < 0.4).to(impl_backend.device)
    keep[:3] = False  # at least one (token, head) pair loses all its routes
    problem = type(full)(cfg, full.x, full.gate, full.bias, full.weights, full.routes,
                         full.table.select(keep))  # some (token, head) pairs keep no route
    validate_route_table(problem.table, cfg)
    out = run_poisoned(impl_backend.impl, problem)
    pairs = torch.zeros(40 * cfg.num_heads, dtype=torch.bool, device=out.device)
    pairs[problem.table.route_slots // cfg.top_k] = True
    unrouted = ~pairs.view(40, cfg.num_heads)
    assert unrouted.any()
    assert (out.view(40, cfg.num_heads, cfg.head_dim)[unrouted] == 0).all()
    v = judge(out, problem, impl_backend.impl)
    v.require()  # typed: an inaccuracy counts under accuracy


@pytest.mark.needs("deterministic")
@pytest.mark.clause("determinism")
def test_protocol_deterministic_reruns_are_bitwise_equal(impl_backend):
    problem = random_problem(impl_backend.impl.fit(preset("tiny")), 45, seed=33,
                             device=impl_backend.device)
    first = run_poisoned(impl_backend.impl, problem)
    for run in range(20):
        again = run_poisoned(impl_backend.impl, problem)
        assert torch.equal(first, again), f"run {run + 2} differs from run 1"


# -- naming an outside implementation ------------------------------------------------------------

def test_spec_loads_the_example_once_under_its_own_name():
    from magi_moe.tests.outside_impl_example import IMPL

    assert get_implementation(SPEC) is IMPL
    assert get_implementation(SPEC) is IMPL and load_implementation(SPEC) is IMPL
    assert get_implementation("torch-einsum") is IMPL
    assert IMPL in implementations()
    assert IMPL.deterministic and IMPL.precision == "bf16-fp32acc"


@pytest.mark.parametrize("spec,message", [
    ("magi_moe.tests.outside_impl_example:NOPE", "has no attribute 'NOPE'"),
    ("magi_no_such_module:IMPL", "importing 'magi_no_such_module' failed"),
    ("magi_moe.tests.outside_impl_example:CHUNK_BYTES", "must be a magi_moe.implementation.Implementation"),
    (":IMPL", "must look like 'package.module:attribute'"),
    ("no-such-implementation", "an entry point of group .magi_moe.implementations."),
])
def test_bad_names_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        get_implementation(spec)


@pytest.mark.parametrize("field,value,message", [
    ("router", "magi_moe.routing:route", "router must be callable or None, got str"),
    ("layer_forward", 3, "layer_forward must be callable or None, got int"),
    ("launcher", "magi_moe.kernels.native:launch_native", "launcher must be a RowLauncher or None"),
])
def test_bad_declarations_are_refused_naming_the_field(field, value, message):
    from magi_moe.implementation import Implementation

    with pytest.raises(ValueError, match=message):
        Implementation("bad-declaration", lambda *a, **k: None, ("cpu",), "bf16-plain",
                       **{field: value})


def test_a_declared_router_is_what_route_calls():
    from magi_moe.implementation import Implementation
    from magi_moe.routing import route

    calls = []

    def router(x, gate, bias, config):
        calls.append(x.shape)
        return route(x, gate, bias, config)

    impl = Implementation("own-router", lambda *a, **k: None, ("cpu",), "bf16-plain", router=router)
    problem = random_problem(preset("tiny"), 12, seed=35)
    got = impl.route(problem.x, problem.gate, problem.bias, problem.config)
    assert calls == [problem.x.shape]
    assert torch.equal(got.expert_ids, problem.routes.expert_ids)


def test_entry_point_is_found_by_name(plugin_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_dir))
    assert "einsum-plugin" in plugins.entry_point_names()
    impl = get_implementation("einsum-plugin")
    assert impl.name == "einsum-plugin" and get_implementation("einsum-plugin") is impl
    assert impl in plugins.discover() and impl in implementations()
    problem = random_problem(preset("tiny"), 20, seed=34)
    v = judge(run_poisoned(impl, problem), problem, impl)
    assert v.ok, v.text


@pytest.mark.parametrize("name,message", [
    ("demo-wrong-name", "provides an implementation named 'not-my-entry-point-name'"),
    ("demo-not-an-impl", "got int"),
    ("demo-missing-module", "cannot load entry point 'demo-missing-module'"),
])
def test_broken_entry_points_are_refused_with_the_reason(broken_dir, monkeypatch, name, message):
    monkeypatch.syspath_prepend(str(broken_dir))
    with pytest.raises(ValueError, match=message):
        get_implementation(name)


def test_an_outside_implementation_cannot_take_a_builtin_name(broken_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_dir))
    native = get_implementation("native")
    with pytest.raises(ValueError, match="named 'native' is already registered"):
        get_implementation("magi_broken_plugins:CLASH")
    assert get_implementation("native") is native


@pytest.mark.slow  # over 10 s on two cores: the slow tier (CI runs it after the quick one)
def test_named_on_the_command_line_results_carry_its_name(plugin_dir, tmp_path):
    """A child pytest, as a kernel team would run it: the example by spec, the plugin by entry
    point, and torch-bf16 (which does not declare determinism) for contrast."""
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(plugin_dir)])}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/test_outside_impl.py",
           "-k", "test_protocol_", "--backend", "cpu", "--impl", SPEC, "--impl", "einsum-plugin",
           "--impl", "torch-bf16", f"--junitxml={report}"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    outcome = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        outcome[case.get("name")] = "skipped: " + skipped.get("message", "") if skipped is not None else (
            "failed" if case.find("failure") is not None or case.find("error") is not None else "passed")
    # the oracle test once per declared dtype (bfloat16 and float32; the plugin: bfloat16), then
    # the zeros and the determinism tests
    for name, rows in (("torch-einsum", 4), ("einsum-plugin", 3)):
        mine = {t: o for t, o in outcome.items()
                if t.endswith(f"[{name}@cpu]") or f"[{name}@cpu-" in t}
        assert len(mine) == rows and set(mine.values()) == {"passed"}, mine
    contrast = outcome["test_protocol_deterministic_reruns_are_bitwise_equal[torch-bf16@cpu]"]
    assert "torch-bf16 does not declare deterministic" in contrast
    assert all(t.split("[")[-1].split("@")[0] in ("torch-einsum", "einsum-plugin", "torch-bf16")
               for t in outcome), sorted(outcome)
