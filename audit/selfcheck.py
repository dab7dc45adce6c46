"""Backend self-check: before trusting a backend, check the operations the kernels rely on.

Each check runs a tiny Triton kernel (:mod:`audit.selfcheck_kernels`) and compares it with
float64 PyTorch:

* bf16 ``tl.dot`` with the kernels' upcast policy (operands upcast to fp32 under the
  interpreter, ``magi_moe.kernels.native``): within fp32 accumulation's gamma_K bound;
* raw bf16 ``tl.dot``: on a GPU it must be right (the compiled kernels use it); under the
  interpreter CONTRACT section 8 says it is wrong -- reported, not failed, so a Triton release that
  fixes (or a GPU build that breaks) it shows up here;
* bf16 loads/stores: masked copy and upcast bit-exact;
* fp32 -> bf16 conversion: to nearest even on a GPU (bitwise equal to ``Tensor.to``). Triton
  3.9's interpreter truncates instead (its ``_convert_float`` drops the low bits): reported as
  info; the kernels round by bit arithmetic when interpreted (``magi_moe.kernels.rounding``)
  and the bounds still hold them to round-to-nearest (``magi_moe.judge.precision.
  with_truncating_downcasts`` is the model a truncating kernel would need);
* fp32 ``tl.atomic_add`` with colliding slots (integers: exact in any order);
* the kernels' fp32 SwiGLU7 within the evaluation allowance that :mod:`magi_moe.judge.bounds` assumes.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from magi_moe.backends import Backend, get_backend, interpreter_enabled
from magi_moe.reference import swiglu7

from magi_moe.judge.bounds import EVAL_ARG, EVAL_OPS, EVAL_UNDERFLOW
from magi_moe.judge.precision import FP32, FP32_ACCUMULATOR_UNIT, gamma


@dataclass
class SelfCheck:
    name: str
    status: str   # "pass", "FAIL", "info" (expected/known behaviour) or "skip"
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _dot_checks(kernels, device, gen) -> list[SelfCheck]:
    M = N = K = 32
    a = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(device)
    b = torch.randn(K, N, generator=gen).to(torch.bfloat16).to(device)
    exact = a.double() @ b.double()
    bound = gamma(K + 1, FP32_ACCUMULATOR_UNIT) * (a.double().abs() @ b.double().abs())
    interpret = interpreter_enabled()
    results = []
    for upcast, label in ((interpret, "bf16 tl.dot, kernels' upcast policy"), (False, "raw bf16 tl.dot")):
        c = torch.full((M, N), float("nan"), dtype=torch.float32, device=device)
        precision = "ieee" if upcast else "tf32"  # as the native kernel passes it
        kernels.launch_dot(a, b, c, upcast=upcast, dot_precision=precision)
        ratio = float(((c.double() - exact).abs() / bound).nan_to_num(math.inf).max())
        ok = ratio <= 1.0
        detail = (f"max |err| / gamma_{K + 1} bound = {ratio:.3g}"
                  f" (max |err| {float((c.double() - exact).abs().nan_to_num(math.inf).max()):.3g})")
        if ok:
            status = "pass"
        elif interpret and not upcast:
            status = "info"
            detail += ": wrong under the interpreter, as CONTRACT section 8 says; the kernels upcast"
        else:
            status = "FAIL"
        if interpret and not upcast and ok:
            status, detail = "info", detail + ": now correct under the interpreter (CONTRACT 8 outdated?)"
        results.append(SelfCheck(label + (" (upcast)" if upcast else ""), status, detail))
    return results


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 toward zero: drop the low 16 bits."""
    return (t.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _load_store_checks(kernels, device, gen) -> list[SelfCheck]:
    n = 1000  # not a multiple of the block: masked tail
    src_bf16 = torch.randn(n, generator=gen).to(torch.bfloat16).to(device)
    src_f32 = torch.randn(n, generator=gen)
    # exact ties between two bf16 neighbours: bf16 value plus half its spacing
    base = torch.randn(64, generator=gen).to(torch.bfloat16).float()
    src_f32[:64] = base + base.abs().log2().floor().exp2() * 2.0 ** -8
    # subnormals (a routing weight can underflow to one), spread over the subnormal range
    src_f32[64:128] = (torch.rand(64, generator=gen) * 2 - 1) * 2.0 ** -126
    src_f32[128:136] *= 2.0 ** -140
    src_f32 = src_f32.to(device)
    subnormal = src_f32.abs() < 2.0 ** -126
    copy = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device)
    upcast = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    down = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device)
    rounded = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.launch_elementwise(kernels.load_store_kernel, src_bf16, src_f32, copy, upcast, down,
                               rounded, n=n, SOFT_BF16=interpreter_enabled())
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    bad = {"copy": int((bits(copy) != bits(src_bf16)).sum()),
           "upcast": int((upcast.view(torch.int32) != src_bf16.float().view(torch.int32)).sum())}
    wrong = {k: v for k, v in bad.items() if v}
    checks = [SelfCheck("bf16 load/store", "FAIL" if wrong else "pass",
                        f"bitwise mismatches {wrong} of {n}" if wrong else
                        f"masked copy and bf16 -> fp32 upcast bit-exact ({n} values)")]
    want = bits(src_f32.to(torch.bfloat16))
    nearest = int((bits(down) != want).sum())
    toward_zero = int(((bits(down) != bits(_truncated(src_f32))) & ~subnormal).sum())
    wrong_subnormals = int(((bits(down) != want) & subnormal).sum())
    if nearest == 0:
        checks.append(SelfCheck(DOWNCAST_CHECK, "pass",
                                f"rounds to nearest even, ties and subnormals included ({n} values, "
                                f"64 ties, {int(subnormal.sum())} subnormals)"))
    elif toward_zero == 0 and interpreter_enabled():
        checks.append(SelfCheck(DOWNCAST_CHECK, "info",
                                f"truncates (rounds toward zero) under the interpreter, and gets "
                                f"{wrong_subnormals} of {int(subnormal.sum())} subnormals wrong: "
                                f"{nearest} of {n} differ from round-to-nearest; kernels round by "
                                f"bit arithmetic here (magi_moe.kernels.rounding, checked below)"))
    else:
        checks.append(SelfCheck(DOWNCAST_CHECK, "FAIL",
                                f"{nearest} of {n} differ from round-to-nearest-even "
                                f"({toward_zero} normal values from truncation, "
                                f"{wrong_subnormals} subnormals)"))
    own = int((bits(rounded) != want).sum())
    checks.append(SelfCheck(ROUNDING_CHECK, "FAIL" if own else "pass",
                            f"{own} of {n} differ from round-to-nearest-even" if own else
                            f"bit-exact round-to-nearest-even ({n} values, ties and subnormals)"))
    return checks


ROUNDING_CHECK = "fp32 -> bf16 rounding (the kernels' round_to)"


DOWNCAST_CHECK = "fp32 -> bf16 conversion"


def truncating_downcasts(checks: list[SelfCheck]) -> bool:
    """True when the self-check found that the backend converts fp32 to bf16 toward zero."""
    return any(c.name == DOWNCAST_CHECK and "truncates" in c.detail for c in checks)


def _atomic_check(kernels, device, gen) -> SelfCheck:
    n, slots = 4096, 37
    values = torch.randint(-1000, 1000, (n,), generator=gen).float().to(device)
    index = torch.randint(0, slots, (n,), generator=gen).to(torch.int32).to(device)
    out = torch.zeros(slots, dtype=torch.float32, device=device)
    kernels.launch_elementwise(kernels.atomic_add_kernel, values, index, out, n=n)
    exact = torch.zeros(slots, dtype=torch.float64, device=device).index_add_(
        0, index.long(), values.double())
    bad = int((out.double() != exact).sum())
    return SelfCheck("fp32 atomic_add", "FAIL" if bad else "pass",
                     f"{bad} of {slots} slots wrong" if bad else
                     f"{n} colliding adds into {slots} slots exact")


def _atomic_subnormal_check(kernels, device, gen) -> SelfCheck:
    """Whether fp32 atomics keep subnormal addends. NVIDIA's flush them to zero (PTX atom.add.f32),
    which the atomic native variant's precision model (``bf16-fp32acc-atomic``) allows for."""
    n = 64
    values = ((torch.rand(n, generator=gen) + 0.5) * 2.0 ** -130).to(device)
    index = torch.arange(n, dtype=torch.int32, device=device)
    out = torch.zeros(n, dtype=torch.float32, device=device)
    kernels.launch_elementwise(kernels.atomic_add_kernel, values, index, out, n=n)
    if torch.equal(out, values):
        return SelfCheck(ATOMIC_SUBNORMAL_CHECK, "pass", f"{n} subnormal addends kept exactly")
    if not bool(out.any()):
        return SelfCheck(ATOMIC_SUBNORMAL_CHECK, "info",
                         f"flushes subnormal addends to zero ({n} of {n}): allowed by the "
                         f"bf16-fp32acc-atomic model of the atomic native kernel")
    return SelfCheck(ATOMIC_SUBNORMAL_CHECK, "FAIL",
                     f"{int((out != values).sum())} of {n} subnormal addends neither kept nor flushed")


ATOMIC_SUBNORMAL_CHECK = "fp32 atomic_add of subnormals"


def _swiglu_check(kernels, device, gen) -> SelfCheck:
    n = 4096
    g = torch.cat([torch.randn(n // 2, generator=gen) * 3, torch.linspace(-60, 10, n // 2)])
    u = torch.cat([torch.randn(n // 2, generator=gen) * 3, torch.linspace(-8, 8, n // 2)])
    g, u = g.to(device), u.to(device)
    out = torch.full((n,), float("nan"), dtype=torch.float32, device=device)
    with warnings.catch_warnings():  # the interpreter's numpy exp overflows for g < -52: by design
        warnings.simplefilter("ignore", RuntimeWarning)
        kernels.launch_elementwise(kernels.swiglu_kernel, g, u, out, n=n)
    exact = swiglu7(g.double(), u.double())
    allowed = ((EVAL_OPS + EVAL_ARG * 1.702 * g.double().abs()) * FP32.unit * exact.abs()
               + EVAL_UNDERFLOW)
    ratio = float(((out.double() - exact).abs() / allowed).nan_to_num(math.inf).max())
    return SelfCheck("fp32 SwiGLU7 (the kernel's)", "pass" if ratio <= 1 else "FAIL",
                     f"max error / evaluation allowance = {ratio:.3g}")


def run_selfcheck(backend: Backend | str, *, seed: int = 0) -> list[SelfCheck]:
    """All checks on ``backend``; a backend that runs no Triton gets one "skip" row."""
    backend = get_backend(backend) if isinstance(backend, str) else backend
    if not backend.runs_triton:
        return [SelfCheck("Triton operations", "skip",
                          f"backend {backend.name} runs no Triton kernels")]
    why = backend.skip_reason()
    if why:
        return [SelfCheck("Triton operations", "skip", why)]
    from . import selfcheck_kernels as kernels  # decorated now, with the interpreter flag set

    gen = torch.Generator().manual_seed(seed)
    device = torch.device(backend.device)
    checks = _dot_checks(kernels, device, gen)
    checks += _load_store_checks(kernels, device, gen)
    checks += [_atomic_check(kernels, device, gen), _atomic_subnormal_check(kernels, device, gen),
               _swiglu_check(kernels, device, gen)]
    return checks
