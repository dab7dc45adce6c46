"""int64 offsets: routed tokens past 2^31 / row stride on lazily allocated inputs (fuzz.huge).

The fuzzed property itself is the ``huge_offsets`` record (rows ``huge_offsets-*`` of
tests/test_fuzz_properties.py): each case runs in a child process (an int32 offset kills it with
SIGSEGV under the interpreter), one case per implementation per commit. Here: what it rests on,
the strategy's edges, and the whole layer past 2^31 on a GPU."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from magi_moe.fuzz.cases import HugeCase, first_overflowing_token
from magi_moe.fuzz.huge import build_huge_problem
from magi_moe.fuzz.strategies import huge_cases
from magi_moe.config import preset
from magi_moe.implementation import Implementation, ShapeRule
from magi_moe.routing import validate_route_table


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_lazy_pages_cost_nothing_and_read_zero():
    """The claim fuzz.huge rests on, checked on this machine: a 4.3 GB torch.empty whose pages are
    never written costs (almost) no memory, and fresh pages read as zero. fuzz.huge still zeroes
    the routed rows itself and does not rely on the second part."""
    before = _resident_mib()
    big = torch.empty(2**31 + 2**20, dtype=torch.bfloat16)
    sample = big[:: 2**26 + 17][:16].float()  # 16 scattered pages (2 MiB each with huge pages)
    grown = _resident_mib() - before
    assert grown < 64, f"touching 16 pages of a lazy 4 GiB tensor cost {grown:.0f} MiB"
    assert bool((sample == 0).all()), "fresh pages of a large torch.empty did not read as zero here"


def test_hand_built_table_is_valid_and_crosses_the_boundary():
    cfg = preset("tiny")
    t0 = first_overflowing_token(cfg)
    assert (t0 - 1) * cfg.hidden_size < 2**31 <= t0 * cfg.hidden_size
    case = HugeCase(cfg, t0 + 8, (0, t0 - 1, t0, t0 + 7), seed=1)
    p = build_huge_problem(case)
    validate_route_table(p.table, cfg)
    assert int(p.table.gather_ids.max()) == t0 + 7
    assert p.table.num_routes == len(case.tokens) * cfg.num_heads * cfg.top_k
    assert torch.equal(p.x[p.tokens], p.small_x)


@settings(max_examples=60, derandomize=True, database=None)
@given(case=huge_cases(config=preset("tiny"), max_extra_tokens=1))
def test_huge_cases_stay_in_range_when_one_token_passes_the_boundary(case):
    """S = t0 + 1: the boundary's neighbour t0 + 1 does not exist (the GPU campaign drew it
    once, and the strategy raised instead of producing a case)."""
    assert case.num_tokens == first_overflowing_token(case.config) + 1
    assert all(0 <= t < case.num_tokens for t in case.tokens)


@pytest.mark.serial
@pytest.mark.kernels_only
@pytest.mark.needs("int64_offsets")
@pytest.mark.clause("int64-offsets")
def test_layer_past_int32_offsets(impl_backend):
    """The whole layer (every kernel that indexes by token: the router's reads of x, the expert
    kernels, the top-k sum's writes of y) on a real 700,100-token input at H=12 (row stride 3072:
    token 699,051 is the first past 2^31): rows around and past the boundary match the float64
    reference of the same tokens. GPU only: the input and output are 4.3 GB each."""
    from magi_moe.audit.cache import draw_state
    from magi_moe.audit.graphs import fresh

    if impl_backend is None or impl_backend.backend.device != "cuda":
        pytest.skip("needs real memory for a 4.3 GB input: the cuda backend")
    impl = impl_backend.impl
    cfg = preset("magi2-full").replace(num_experts=4, top_k=2)
    why = impl.supports(cfg)
    if why:
        pytest.skip(why)
    t0 = first_overflowing_token(cfg)
    layer = impl.layer(cfg, draw_state(cfg, seed=5, device="cuda"), "cuda")
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(t0 + 1049, cfg.hidden_size, generator=gen, device="cuda").to(cfg.dtype)
    with torch.no_grad():
        y = layer(x)
    rows = torch.tensor([0, t0 - 2, t0 - 1, t0, t0 + 1, t0 + 517, x.shape[0] - 1], device="cuda")
    ok, how = fresh(cfg, layer, x[rows], y[rows])
    assert ok, f"{impl.name}: rows around token {t0} (offset 2^31) are wrong: {how}"


NARROW = ShapeRule(head_dim_multiple=48, intermediate_multiple=80, min_head_dim=96,
                   max_head_dim=192, max_top_k=2)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float16,)], ids=["bf16", "fp16-only"])
def test_the_huge_fuzzer_draws_inside_the_declared_shapes(dtypes):
    """Every case the huge-offset property draws for an implementation with a narrow shape rule
    (and declared dtypes) is one it accepts: a case outside is returned as unsupported and never
    run, so a strategy that stopped honouring the rule would fail nothing else."""
    from hypothesis import HealthCheck

    from magi_moe.fuzz.fuzzers import PROPERTIES
    from magi_moe.fuzz.properties import make_target

    impl = Implementation("narrow-huge", lambda *a, **k: None, ("cpu",), "bf16-fp32acc",
                          dtypes=dtypes, capabilities={"int64_offsets"}, shapes=NARROW)
    target = make_target(impl, "cpu", spec="magi_moe.tests.test_fuzz_huge:unused")
    drawn: list[HugeCase] = []

    @settings(max_examples=150, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(pair=PROPERTIES["huge_offsets"].strategy(target))
    def draw(pair):
        case, _ = pair
        drawn.append(case)
        why = impl.supports(case.config)
        assert why is None, f"drew {case.config} outside the declared rule: {why}"
        assert max(case.tokens) >= first_overflowing_token(case.config)

    draw()
    widths = {(c.config.head_dim, c.config.intermediate_size) for c in drawn}
    assert len(drawn) >= 100 and len(widths) > 1, widths  # not one fixed shape
