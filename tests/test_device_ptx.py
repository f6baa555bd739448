"""The device kernel as a GPU runs it: every layout compiled here to sm_90 PTX (Triton bundles LLVM and ptxas, so no
GPU is needed), with its random arguments equal to 1, and the PTX read for what would break the host's bits.

Triton's interpreter, which the other device-kernel tests run, rounds as IEEE does whatever the source says; a GPU
build can flush denormals (``.ftz``), approximate (``.approx``, ``div.full``), fuse a multiply and an add, or call
libdevice. Here each variant's PTX must hold only correctly rounded float operations (``.rn``), no float ``max``/
``min`` (NaN rules differ from the host's), no bf16 or float-to-int conversion (the kernel rounds with integer bit
arithmetic, as the host does), and exactly the host kernel's fused multiply-adds: the L2 term's, with its scaled copy
under the x86 rule, one per division the element makes.
"""

from __future__ import annotations

import re
import types
from typing import Any

import pytest
import torch
from test_device_kernel import LAYOUTS, make_tuple

triton = pytest.importorskip("triton", reason="the device kernel is written in Triton")
pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from cpu_adam import device_kernel  # noqa: E402
from cpu_adam.device_kernel import kernels, launch  # noqa: E402

pytestmark = pytest.mark.slow

SM90 = GPUTarget("cuda", 90, 32)
FORBIDDEN = {
    "flush to zero": r"\.ftz\b",
    "approximation": r"\.approx\b|\bdiv\.full\b",
    "float max/min": r"\b(?:max|min)(?:\.\w+)*\.f(?:16|32|64)\b",
    "bf16 conversion": r"\bcvt(?:\.\w+)*\.bf16(?:x2)?\b",
    "float-to-int conversion": r"\bcvt(?:\.\w+)*\.[su](?:8|16|32|64)\.f(?:16|32|64)\b",
    "libdevice call": r"\bcall\b|__nv_",
}
FLOAT_OP = re.compile(r"\b(add|sub|mul|div|sqrt|fma)((?:\.\w+)*)\.f(?:32|64)\b")


def ptx_for_sm90(kernel: JITFunction, args: tuple, kwargs: dict[str, Any]) -> str:
    """The PTX a GPU of compute capability 9.0 would run for this launch, specialised as Triton specialises it."""
    backend = make_backend(SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=SM90, options=options.__dict__).asm["ptx"]


def variant(index: int, layout: tuple[str, str, str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A one-element step of ``layout`` whose flags turn with ``index``: rule, L2 or decoupled decay, stochastic
    rounding, output, beta1 = 0; every random key 1."""
    kwargs = dict(
        step=3,
        lr=1e-2,
        beta1=0.0 if index % 3 == 2 else 0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.1,
        adamw_mode=index % 4 < 2,
        stochastic_rounding=index % 5 < 3,
        seed=1,
        before_rounding=bool(index % 2),
    )
    tensors = make_tuple(1, layout, seed=index)
    if index % 3 == 0:
        tensors["out"] = torch.zeros(1, dtype=torch.bfloat16)
    return tensors, kwargs


def recorded_launches(monkeypatch: pytest.MonkeyPatch, tensors: dict[str, torch.Tensor], **kwargs: Any) -> list:
    """The launches ``prepare_step`` makes, with the compiled kernels (not the interpreter's) and every key 1."""
    launches: list[tuple[Any, tuple, dict[str, Any]]] = []
    monkeypatch.setattr(launch, "for_device", lambda kernel, device: kernel)
    monkeypatch.setattr(device_kernel, "_key", lambda *_: 1)
    monkeypatch.setattr(device_kernel.Launches, "add", lambda self, k, grid, a, kw: launches.append((k, a, kw)))
    device_kernel.prepare_step(
        [tensors["param"]],
        [tensors["grad"]],
        [tensors["exp_avg"]],
        [tensors["exp_avg_sq"]],
        bf16_outs=[tensors["out"]] if "out" in tensors else None,
        state_scales=[tensors["scales"]] if "scales" in tensors else None,
        **kwargs,
    )
    return launches


def findings(ptx: str, has_l2: bool) -> list[str]:
    """What in ``ptx`` would give other bits than the host kernel's."""
    found = [f"{name}: {m.group(0)}" for name, pattern in FORBIDDEN.items() for m in re.finditer(pattern, ptx)]
    found += [f"not rounded to nearest: {m.group(0)}" for m in FLOAT_OP.finditer(ptx) if ".rn" not in m.group(2)]
    fmas, divisions = len(re.findall(r"\bfma\.rn\.f32\b", ptx)), len(re.findall(r"\bdiv\.rn\.f32\b", ptx))
    if fmas != (divisions if has_l2 else 0):
        found.append(f"{fmas} fma.rn.f32 where the host has {'one per division' if has_l2 else 'none'} ({divisions})")
    return found


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["-".join(layout) for layout in LAYOUTS])
def test_every_variant_compiles_for_sm90_with_keys_of_1_into_rounded_arithmetic(
    index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors, kwargs = variant(index, LAYOUTS[index])
    for kernel, args, options in recorded_launches(monkeypatch, tensors, **kwargs):
        assert args[args.index(1) :].count(1) >= 2, "the keys reach the kernel as 1"
        ptx = ptx_for_sm90(kernel, args, options)
        assert findings(ptx, options["HAS_L2"]) == []


@triton.jit
def _slash_div(a, b, BEFORE_ROUNDING: tl.constexpr):
    return a / b


def _copy(kernel: JITFunction, namespace: dict[str, Any], **jit_options: Any) -> JITFunction:
    fn = kernel.fn
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__)
    copy.__annotations__ = fn.__annotations__  # the constexpr parameters
    return JITFunction(copy, **jit_options)


def test_a_division_written_as_slash_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check can fail: Triton compiles "/" on float32 to an approximate division.
    namespace = dict(vars(kernels), div=_slash_div)
    namespace["update"] = _copy(kernels.update, namespace)
    mutant = _copy(kernels.adam_kernel, namespace, do_not_specialize=kernels.RANDOM_ARGUMENTS)
    tensors, kwargs = variant(0, ("f32", "f32", "f32"))
    (_, args, options), *_ = recorded_launches(monkeypatch, tensors, **kwargs)
    found = findings(ptx_for_sm90(mutant, args, options), options["HAS_L2"])
    assert any(f.startswith("approximation") for f in found), found


def test_a_key_of_1_specialised_as_a_constant_does_not_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # What do_not_specialize prevents: the kernel reads its keys' bits, which a constant does not have.
    plain = _copy(kernels.adam_kernel, vars(kernels))
    tensors, kwargs = variant(1, ("bf16", "bf16", "bf16"))
    (_, args, options), *_ = recorded_launches(monkeypatch, tensors, **kwargs)
    with pytest.raises(Exception, match="has no attribute 'to'"):
        ptx_for_sm90(plain, args, options)
