""""Can it run here" has one answer, ``Implementation.skip_reason``: the test matrix (a backend),
the layer and dispatch (tensors on a device), the audit and the fuzzers all ask it; and "is the
oracle" is one predicate, ``Implementation.is_oracle``."""
from __future__ import annotations

import pytest
import torch

import magi_moe.backends as backends
from magi_moe.dispatch import choose_implementation
from magi_moe.impls import BUILTINS, FUSED, NATIVE, REFERENCE, TORCH_BF16
from magi_moe.layer import _check_runs_here

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def here(monkeypatch):
    """Sets whether Triton is installed and the interpreter enabled, as a process would see them."""
    def set_(*, triton: bool, interpret: bool) -> None:
        monkeypatch.setattr(backends, "_TRITON_INSTALLED", triton)
        monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    return set_


def test_only_the_float64_reference_is_the_oracle():
    assert [i.name for i in BUILTINS if i.is_oracle] == [REFERENCE.name]


@pytest.mark.parametrize("impl, device, backend", [
    (REFERENCE, CPU, "cpu"), (TORCH_BF16, CPU, "cpu"),   # plain PyTorch where declared
    (FUSED, CPU, "interpret"), (NATIVE, CPU, "interpret"),
    (FUSED, GPU, "cuda"), (REFERENCE, GPU, "cuda"),
    (FUSED, torch.device("meta"), "meta"),
])
def test_the_backend_on_a_device(impl, device, backend):
    assert impl.backend_on(device) == backend


@pytest.mark.parametrize("impl, device, triton, interpret, reason", [
    (REFERENCE, CPU, False, False, None),
    (FUSED, CPU, True, True, None),
    (FUSED, CPU, True, False, "backend interpret unavailable: TRITON_INTERPRET=1 was not set"),
    (FUSED, CPU, False, True, "backend interpret unavailable: triton is not installed"),
    # tensors already on a GPU: only Triton is asked, and only of a Triton implementation
    (FUSED, GPU, True, False, None),
    (FUSED, GPU, True, True, None),
    (FUSED, GPU, False, False, "backend cuda unavailable: triton is not installed"),
    (REFERENCE, GPU, False, False, None),
    (FUSED, torch.device("meta"), True, True, "fused does not declare backend meta"),
])
def test_skip_reason_on_a_device(here, impl, device, triton, interpret, reason):
    here(triton=triton, interpret=interpret)
    why = impl.skip_reason(device)
    assert why == reason if reason is None else why.startswith(reason), why


@pytest.mark.parametrize("triton, interpret", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("device", [CPU, GPU])
def test_the_layer_refuses_exactly_where_skip_reason_says_and_dispatch_agrees(here, device, triton, interpret):
    """A forced implementation is refused where it cannot run; dispatch picks a Triton path
    exactly where the Triton implementations can run."""
    here(triton=triton, interpret=interpret)
    x = torch.empty(0, 4) if device == CPU else None  # no GPU tensor here: the layer on CPU only
    for impl in BUILTINS:
        why = impl.skip_reason(device)
        if x is not None:
            if why:
                with pytest.raises(ValueError, match=f"impl: '{impl.name}' runs on the backends"):
                    _check_runs_here(impl, x)
            else:
                _check_runs_here(impl, x)
    kernels = NATIVE.skip_reason(device) is None
    assert kernels == (triton and (device == GPU or interpret))
    picked = choose_implementation(device, torch.bfloat16)
    assert (picked is REFERENCE) == (not kernels)


def test_a_backend_row_still_means_what_the_backend_says(here):
    """The matrix's ``cuda`` row is compiled Triton: not usable under the interpreter flag,
    even for an implementation whose tensors could sit on a GPU."""
    here(triton=True, interpret=True)
    assert REFERENCE.skip_reason("cuda").startswith("backend cuda unavailable")
    assert FUSED.skip_reason("cpu") == "fused does not declare backend cpu"
    assert FUSED.skip_reason(backends.BACKENDS["interpret"], needs=("weight_cache",)) is None
    assert NATIVE.skip_reason("interpret", needs=("weight_cache",)) == "native does not declare weight_cache"
