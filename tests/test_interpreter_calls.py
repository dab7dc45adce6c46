"""The interpreter shortcut (``magi_moe/kernels/interpreter_calls.py``): a launch maps
``triton.language`` once instead of at every helper call, and the kernels' bits stay the same."""
from __future__ import annotations

import pytest
import torch

from magi_moe.backends import BACKENDS
from magi_moe.config import preset
from magi_moe.problems import same_bits

pytestmark = pytest.mark.interpret


@pytest.fixture
def interpreter():
    why = BACKENDS["interpret"].unavailable_reason()
    if why:
        pytest.skip(f"backend interpret unavailable: {why}")
    from triton.runtime import interpreter as module

    from magi_moe.kernels import interpreter_calls
    if not interpreter_calls._applies(module):
        pytest.skip("this Triton's interpreter has no per-launch scope: the shortcut stays off")
    yield module
    interpreter_calls.install()  # as the session had it


def fused_layer_and_native_det(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused layer (router and expert kernels, many helper calls) and native-det, poisoned
    outputs, on one drawn input."""
    from magi_moe.impls import BUILTINS
    from magi_moe.layer import MagiMoE
    from magi_moe.problems import random_problem, run_poisoned

    cfg = preset("small")
    torch.manual_seed(seed)
    layer = MagiMoE(cfg, impl="fused", device="cpu")
    with torch.no_grad():
        layer.router.expert_bias_ema.normal_(0.0, 0.05)
    x = torch.randn(37, cfg.hidden_size).bfloat16()
    native_det = next(i for i in BUILTINS if i.name == "native-det")
    problem = random_problem(cfg, 29, seed=seed)
    return layer(x), run_poisoned(native_det, problem)


def test_the_shortcut_gives_tritons_bits(interpreter):
    from magi_moe.kernels import interpreter_calls

    interpreter_calls.uninstall()
    plain = fused_layer_and_native_det(5)
    assert interpreter_calls.install()
    shortcut = fused_layer_and_native_det(5)
    for a, b in zip(plain, shortcut):
        assert not a.isnan().any()
        assert same_bits(a, b)


def test_a_launch_maps_the_language_once(interpreter, monkeypatch):
    """Triton's mapping runs once a launch, not once a helper call."""
    from magi_moe.kernels import interpreter_calls

    interpreter_calls.uninstall()
    original, calls = interpreter._patch_lang, []

    def counted(fn):
        calls.append((fn.__module__, fn.__name__))
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counted)
    fused_layer_and_native_det(6)
    per_call = len(calls)
    calls.clear()
    assert interpreter_calls.install()  # now over the counting mapping
    fused_layer_and_native_det(6)
    assert per_call > 3 * len(calls), (per_call, calls)
    # what is still mapped: the launches, and helpers that see a language module their launch
    # does not (Triton's own library, e.g. tl.cumsum sees triton.language.core)
    assert all(name.endswith("_kernel") or module.startswith("triton.language")
               for module, name in calls), set(calls)
    interpreter_calls.uninstall()  # before monkeypatch puts Triton's own back


def test_the_shortcut_is_on_wherever_it_applies(interpreter):
    from magi_moe.kernels import interpreter_calls

    assert interpreter_calls.installed(), "TRITON_INTERPRET=1 runs should get the shortcut"
