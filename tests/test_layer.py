"""The nn.Module: checkpoint names and shapes, loading, bias sources, dispatch, validation."""
import pytest
import torch

from magi_moe import MagiMoE, preset
from magi_moe.dispatch import choose_implementation
from magi_moe.problems import relative_l2
from magi_moe.reference import layer_reference
from magi_moe.weights import ExpertWeights


def released_layout(cfg):
    HE, Dh, I = cfg.num_banks, cfg.head_dim, cfg.intermediate_size
    return {"gate": (HE, Dh), "W_gate": (HE, Dh, I), "W_up": (HE, Dh, I), "W_down": (HE, I, Dh),
            "router.expert_bias": (HE,), "router.expert_bias_ema": (HE,)}


@pytest.mark.parametrize("name", ["tiny", "magi2-ep4-local"])
def test_parameter_names_shapes_and_dtypes_follow_the_checkpoint_layout(name):
    cfg = preset(name)
    layer = MagiMoE(cfg, device="meta")
    sd = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == released_layout(cfg)
    assert sd["gate"].dtype == torch.float32 and sd["router.expert_bias"].dtype == torch.float32
    assert sd["W_gate"].dtype == sd["W_down"].dtype == cfg.dtype


def random_checkpoint(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = released_layout(cfg)
    sd = {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}
    sd["gate"] *= 0.25
    sd["router.expert_bias"] *= 0.05
    sd["router.expert_bias_ema"] *= 0.05
    for k in ("W_gate", "W_up", "W_down"):
        sd[k] = (sd[k] * 0.02).to(cfg.dtype)
    return sd


def test_from_state_dict_loads_the_released_layout_and_matches_the_oracle():
    cfg = preset("tiny")
    sd = random_checkpoint(cfg)
    layer = MagiMoE.from_state_dict(sd, cfg)
    for k, v in sd.items():
        assert torch.equal(layer.state_dict()[k], v)
    x = torch.randn(40, cfg.hidden_size).bfloat16()
    y = layer(x)
    weights = ExpertWeights(sd["W_gate"], sd["W_up"], sd["W_down"])
    ref, _ = layer_reference(x, sd["gate"], sd["router.expert_bias_ema"], weights, cfg,
                             router_dtype=torch.float32)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert relative_l2(y, ref) < 1e-2


@pytest.mark.parametrize("source", ["expert_bias_ema", "expert_bias", "none"])
def test_bias_source_chooses_which_bias_routes(source):
    cfg = preset("tiny")
    sd = random_checkpoint(cfg)
    # Opposite large biases: each source forces a different expert to the top.
    sd["router.expert_bias"] = torch.zeros(cfg.num_banks)
    sd["router.expert_bias"][0::cfg.num_experts] = 5.0
    sd["router.expert_bias_ema"] = torch.zeros(cfg.num_banks)
    sd["router.expert_bias_ema"][1::cfg.num_experts] = 5.0
    layer = MagiMoE.from_state_dict(sd, cfg, bias_source=source)
    bias = layer.selection_bias
    if source == "none":
        assert bias is None
    else:
        assert torch.equal(bias, sd[f"router.{source}"])


@pytest.mark.parametrize("make_bad, pattern", [
    pytest.param(lambda sd: {k: v for k, v in sd.items() if k != "W_up"}, r"missing \['W_up'\]",
                 id="missing"),
    pytest.param(lambda sd: {**sd, "extra": torch.zeros(1)}, r"unexpected \['extra'\]",
                 id="unexpected"),
    pytest.param(lambda sd: {**sd, "W_down": sd["W_down"].transpose(1, 2)},
                 r"state_dict\['W_down'\] must have shape \[16, 64, 32\]", id="misshapen"),
])
def test_from_state_dict_names_missing_unexpected_and_misshapen_keys(make_bad, pattern):
    cfg = preset("tiny")
    with pytest.raises(ValueError, match=pattern):
        MagiMoE.from_state_dict(make_bad(random_checkpoint(cfg)), cfg)


@pytest.mark.parametrize("key", ["gate", "router.expert_bias", "router.expert_bias_ema"])
def test_non_finite_router_weights_are_rejected_at_load(key):
    cfg = preset("tiny")
    sd = random_checkpoint(cfg)
    sd[key] = sd[key].clone()
    sd[key].view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match=rf"state_dict\['{key}'\] must be finite"):
        MagiMoE.from_state_dict(sd, cfg)


@pytest.mark.parametrize("make_x, exc, pattern", [
    pytest.param(lambda H: torch.randn(2, 3, H).bfloat16(), ValueError, "x must have rank 2",
                 id="rank-3"),
    pytest.param(lambda H: torch.randn(4, 32).bfloat16(), ValueError, r"x must have shape \[\*, 64\]",
                 id="width"),
    pytest.param(lambda H: torch.randn(4, H), ValueError, "x must have dtype bfloat16, got float32",
                 id="float32"),
    pytest.param(lambda H: [[0.0] * H], TypeError, "x must be a torch.Tensor", id="list"),
])
def test_forward_rejects_bad_input(make_x, exc, pattern):
    cfg = preset("tiny")
    layer = MagiMoE(cfg)
    with pytest.raises(exc, match=pattern):
        layer(make_x(cfg.hidden_size))


@pytest.mark.parametrize("kwargs, pattern", [
    pytest.param(dict(bias_source="ema"), "bias_source must be one of", id="bias_source"),
    pytest.param(dict(impl="fastest"), "implementation must be one of", id="impl"),
])
def test_layer_rejects_unknown_bias_source_and_implementation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MagiMoE(preset("tiny"), **kwargs)


def test_dispatch_policy():
    """The policy written in magi_moe/dispatch.py, case by case."""
    from magi_moe.backends import interpreter_enabled, triton_installed
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kernels_on_cpu = interpreter_enabled() and triton_installed()
    for deterministic in (False, True):
        pick = lambda device, dtype: choose_implementation(  # noqa: E731
            device, dtype, deterministic=deterministic).name
        native = "native-det" if deterministic else "native"
        assert pick(cpu, torch.float64) == "reference"
        assert pick(cpu, torch.bfloat16) == ("fused" if kernels_on_cpu else "reference")
        assert pick(cpu, torch.float32) == (native if kernels_on_cpu else "reference")
        if torch.cuda.is_available() and triton_installed() and not interpreter_enabled():
            assert pick(cuda, torch.bfloat16) == pick(cuda, torch.float16) == "fused"
            assert pick(cuda, torch.float32) == native


def test_dispatch_reads_compilable_while_tracing(monkeypatch):
    """Under torch.compile tracing dispatch keeps ``fused`` only while it declares
    ``compilable``; without the capability it falls back to native."""
    import dataclasses

    from magi_moe import dispatch
    from magi_moe.backends import interpreter_enabled, triton_installed
    if not (interpreter_enabled() and triton_installed()):
        pytest.skip("needs the Triton interpreter (kernels on the CPU)")
    cpu = torch.device("cpu")
    monkeypatch.setattr(dispatch, "_compiling", lambda: True)
    assert "compilable" in dispatch.FUSED.capabilities
    assert choose_implementation(cpu, torch.bfloat16).name == "fused"
    plain = dataclasses.replace(dispatch.FUSED,
                                capabilities=dispatch.FUSED.capabilities - {"compilable"})
    monkeypatch.setattr(dispatch, "FUSED", plain)
    assert choose_implementation(cpu, torch.bfloat16).name == "native"
    assert choose_implementation(cpu, torch.bfloat16, deterministic=True).name == "native-det"


@pytest.mark.parametrize("cast", ["to-bf16", "half", "float-then-bf16"])
def test_module_casts_keep_the_router_fp32_and_unrounded(cast):
    """``layer.to(dtype)`` and friends cast the expert weights but leave the router's gate and
    selection biases in fp32 with their exact values (found by the GPU weight-swap fuzzer: a
    bf16 gate made the fused router refuse to run)."""
    layer = MagiMoE(preset("tiny"))
    with torch.no_grad():
        layer.router.expert_bias.normal_()
        layer.router.expert_bias_ema.normal_()
    router = {n: t.detach().clone() for n, t in (("gate", layer.gate),
                                                 ("bias", layer.router.expert_bias),
                                                 ("ema", layer.router.expert_bias_ema))}
    w_down = layer.W_down.detach().clone()
    if cast == "to-bf16":
        layer.to(torch.bfloat16)
        want = torch.bfloat16
    elif cast == "half":
        layer.half()
        want = torch.float16
    else:
        layer.float()
        assert layer.W_down.dtype == torch.float32
        layer.to(torch.bfloat16)
        want = torch.bfloat16
    assert layer.W_gate.dtype == layer.W_up.dtype == layer.W_down.dtype == want
    assert torch.equal(layer.W_down.float(), w_down.to(want).float())
    for got, name in ((layer.gate, "gate"), (layer.router.expert_bias, "bias"),
                      (layer.router.expert_bias_ema, "ema")):
        assert got.dtype == torch.float32, name
        assert torch.equal(got, router[name]), name
    assert isinstance(layer.gate, torch.nn.Parameter)
    if want == torch.bfloat16:  # the config's dtype: the layer still runs
        x = torch.randn(5, layer.config.hidden_size).to(torch.bfloat16)
        assert torch.isfinite(layer(x).float()).all()
