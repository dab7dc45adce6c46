"""The packed-weight cache (CONTRACT section 5) and what ``magi_moe.packed_weights`` promises:

* the parameters become the bank's two dense buffers (no second copy of gate/up), which
  safetensors can save as they are;
* no repack while nothing changed (``pack_count`` stays);
* in-place change routes write the bank itself: no repack is needed and none happens;
* swap routes (``.data =``, ``assign=True``, ``set_``, ``.to``) are detected and repacked, into
  the same bank while shapes, dtype and device stay;
* ``invalidate()`` forces a repack;
* with the kernels (interpreter or CUDA), the layer's output follows every route.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from magi_moe.judge import judge
from magi_moe.config import preset
from magi_moe.layer import MagiMoE
from magi_moe.packed_weights import PackedWeightCache, gate_up_views, is_packed_pair
from magi_moe.problems import Problem
from magi_moe.routing import build_route_table, route

CFG = preset("tiny")


def params(seed: int = 0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    shape = (CFG.num_banks, CFG.head_dim, CFG.intermediate_size)
    return (nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(dtype)),
            nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(dtype)))


def fresh_like(p: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype)


def test_pack_makes_the_parameters_the_banks_buffers():
    wg, wu = params()
    values = wg.detach().clone(), wu.detach().clone()
    cache = PackedWeightCache()
    cache.ensure(wg, wu)
    assert cache.pack_count == 1 and cache.is_current(wg, wu)
    assert is_packed_pair(wg, wu)
    gate, up = gate_up_views(cache.bank)
    assert wg.data_ptr() == gate.data_ptr() and wu.data_ptr() == up.data_ptr()
    assert torch.equal(wg, values[0]) and torch.equal(wu, values[1])
    assert wg.requires_grad and isinstance(wg, nn.Parameter)


def test_no_repack_without_a_change():
    wg, wu = params()
    cache = PackedWeightCache()
    for _ in range(5):
        cache.ensure(wg, wu)
    assert cache.pack_count == 1


def _inplace_mul(wg, wu):
    with torch.no_grad():
        wu.mul_(-1.5)


def _copy_under_no_grad(wg, wu):
    with torch.no_grad():
        wg.copy_(fresh_like(wg, 1))


def _data_copy(wg, wu):
    wg.data.copy_(fresh_like(wg, 2))  # bypasses the version counter


def _inference_mode_copy(wg, wu):
    with torch.inference_mode():
        wu.copy_(fresh_like(wu, 3))


def _load_state_dict(wg, wu):
    holder = nn.Module()
    holder.wg, holder.wu = wg, wu
    holder.load_state_dict({"wg": fresh_like(wg, 4), "wu": fresh_like(wu, 5)})


INPLACE_ROUTES = [_inplace_mul, _copy_under_no_grad, _data_copy, _inference_mode_copy,
                  _load_state_dict]


@pytest.mark.parametrize("change", INPLACE_ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_inplace_changes_write_the_bank_and_need_no_repack(change):
    wg, wu = params()
    cache = PackedWeightCache()
    cache.ensure(wg, wu)
    before = wg.detach().clone(), wu.detach().clone()
    change(wg, wu)
    assert not (torch.equal(wg, before[0]) and torch.equal(wu, before[1])), "the route changed nothing"
    assert cache.is_current(wg, wu)
    gate, up = gate_up_views(cache.bank)
    assert torch.equal(gate, wg.detach()) and torch.equal(up, wu.detach())
    cache.ensure(wg, wu)
    assert cache.pack_count == 1


def _assign_data(wg, wu):
    new = fresh_like(wg, 6)
    wg.data = new
    return new, None


def _assign_inference_tensor(wg, wu):
    with torch.inference_mode():
        new = fresh_like(wu, 7) + 0  # an inference tensor: no version counter
    wu.data = new
    return None, new


def _set_storage(wg, wu):
    new = fresh_like(wu, 8)
    with torch.no_grad():
        wu.set_(new)
    return None, new


SWAP_ROUTES = [_assign_data, _assign_inference_tensor, _set_storage]


@pytest.mark.parametrize("swap", SWAP_ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_swaps_are_detected_and_refill_the_bank_in_place(swap):
    """A swap of the same shape, dtype and device is copied into the existing bank (a captured
    CUDA graph keeps reading valid, current weights); the parameters point at it again."""
    wg, wu = params()
    cache = PackedWeightCache()
    cache.ensure(wg, wu)
    bank_ptrs = [t.data_ptr() for t in cache.bank]
    alias = wg.detach()  # an alias of the bank
    new_g, new_u = swap(wg, wu)
    assert not cache.is_current(wg, wu)
    cache.ensure(wg, wu)
    assert cache.pack_count == 2 and cache.is_current(wg, wu)
    if new_g is not None:
        assert torch.equal(wg, new_g) and torch.equal(alias, new_g)
    if new_u is not None:
        assert torch.equal(wu, new_u)
    # refilled in place: a CUDA graph captured before the swap reads the new values
    assert [t.data_ptr() for t in cache.bank] == bank_ptrs and torch.equal(alias, wg.detach())
    for new in (new_g, new_u):
        if new is not None:
            assert new.untyped_storage().data_ptr() not in bank_ptrs, "the swapped-in tensor is not aliased"
    with torch.no_grad():
        wu.add_(1.0)  # still an ordinary, writable parameter (also after an inference tensor)


def test_load_state_dict_with_assign_refills_the_bank_in_place():
    """The CUDA-graph promise: assign=True with tensors that fit the existing ones (shape,
    dtype, device) copies into the existing storage, so a captured graph stays valid."""
    layer = MagiMoE(CFG, impl="fused")
    bank_ptr, down_ptr = layer.W_gate.data_ptr(), layer.W_down.data_ptr()
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    sd["W_gate"] = fresh_like(layer.W_gate, 10)
    sd["W_down"] = fresh_like(layer.W_down, 11)
    layer.load_state_dict(sd, assign=True)
    assert layer.weight_cache.is_current(layer.W_gate, layer.W_up)
    assert layer.W_gate.data_ptr() == bank_ptr and layer.W_down.data_ptr() == down_ptr
    assert torch.equal(layer.W_gate, sd["W_gate"]) and torch.equal(layer.W_down, sd["W_down"])
    layer.weight_cache.ensure(layer.W_gate, layer.W_up)
    assert layer.weight_cache.pack_count == 1, "a refill in place needs no repack"


def test_dtype_conversion_is_a_swap():
    layer = MagiMoE(CFG, impl="fused")
    layer.half()
    assert layer.W_gate.dtype == torch.float16 and layer.W_gate.is_contiguous()
    assert not layer.weight_cache.is_current(layer.W_gate, layer.W_up)
    layer.weight_cache.ensure(layer.W_gate, layer.W_up)
    assert layer.weight_cache.bank.dtype == torch.float16


def test_invalidate_forces_a_fresh_bank():
    wg, wu = params()
    cache = PackedWeightCache()
    cache.ensure(wg, wu)
    first = cache.bank
    values = wg.detach().clone()
    cache.invalidate()
    assert cache.bank is None and not cache.is_current(wg, wu)
    cache.ensure(wg, wu)
    assert cache.pack_count == 2 and cache.bank.gate.data_ptr() != first.gate.data_ptr()
    assert torch.equal(wg, values)


def test_layer_protocol():
    layer = MagiMoE(CFG, impl="fused")
    assert layer.weight_cache.pack_count == 1, "impl='fused' packs at construction"
    assert is_packed_pair(layer.W_gate, layer.W_up)
    layer.invalidate_weight_cache()
    assert layer.weight_cache.bank is None
    assert MagiMoE(CFG, impl="native").weight_cache is None
    assert MagiMoE(CFG).weight_cache.pack_count == 0, "dispatching layers pack on first fused use"
    assert "W_gate" in layer.state_dict() and layer.state_dict()["W_gate"].shape == layer.W_gate.shape


# ---------------------------------------------------------------------------------------------
# with the kernels: the output follows every route
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def device(triton_device) -> torch.device:
    return triton_device


@torch.no_grad()
def assert_layer_uses_current_weights(layer: MagiMoE, x: torch.Tensor) -> None:
    y = layer(x)
    cfg = layer.config
    routes = route(x, layer.gate, layer.selection_bias, cfg)
    weights = type(layer.expert_weights())(*(w.detach() for w in layer.expert_weights()))
    problem = Problem(cfg, x, layer.gate.detach(), layer.selection_bias, weights, routes,
                      build_route_table(routes, cfg))
    v = judge(y, problem, layer.implementation(x))
    assert v.ok, v.text


def _swap_gate(layer):
    layer.W_gate.data = fresh_like(layer.W_gate, 20).to(layer.W_gate.device)


def _inplace_up(layer):
    with torch.no_grad():
        layer.W_up.mul_(-2.0)


def _data_copy_gate(layer):
    layer.W_gate.data.copy_(fresh_like(layer.W_gate, 21))


def _state_dict(layer):
    sd = {k: v.clone() for k, v in layer.state_dict().items()}
    sd["W_up"] = fresh_like(layer.W_up, 22)
    sd["W_down"] = fresh_like(layer.W_down, 23)
    layer.load_state_dict(sd)


LAYER_ROUTES = [_inplace_up, _data_copy_gate, _state_dict, _swap_gate]


def test_layer_output_follows_every_change_route(device):
    torch.manual_seed(0)
    layer = MagiMoE(CFG, impl="fused", device=device)
    x = torch.randn(16, CFG.hidden_size, device=device).bfloat16()
    assert_layer_uses_current_weights(layer, x)
    packs = layer.weight_cache.pack_count
    for change in LAYER_ROUTES:
        before = layer(x)
        change(layer)
        after = layer(x)
        assert not torch.equal(after, before), f"{change.__name__}: output did not change"
        assert_layer_uses_current_weights(layer, x)
    assert layer.weight_cache.pack_count == packs + 1, "only the swap repacks"
    layer(x)
    assert layer.weight_cache.pack_count == packs + 1, "no repack without a change"


def test_device_move_is_a_swap(device):
    if device.type != "cuda":
        pytest.skip("needs a second device")
    torch.manual_seed(0)
    layer = MagiMoE(CFG, impl="fused")
    layer.to(device)
    x = torch.randn(40, CFG.hidden_size, device=device).bfloat16()
    assert_layer_uses_current_weights(layer, x)
    assert layer.weight_cache.pack_count == 2 and layer.weight_cache.bank.device.type == "cuda"
