from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpu_adam import ops

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# (param, grad, state) dtype names: every combination the kernel accepts.
LAYOUTS = [(p, g, s) for p in DTYPES for g in DTYPES for s in DTYPES]
FP32_UNIT_ROUNDOFF = 2.0**-24


def vector_isas() -> list[str]:
    return [name for name in ops.supported_isas() if name != "scalar"]


@pytest.fixture(params=ops.supported_isas())
def isa(request: pytest.FixtureRequest):
    with ops.force_isa(request.param):
        yield request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float32 or bfloat16 tensor, as integers."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bitwise equal, except that a NaN only has to be a NaN (payloads may differ)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    both_nan = actual.isnan() & expected.isnan()
    differ = (bits(actual) != bits(expected)) & ~both_nan
    if differ.any():
        i = int(differ.nonzero()[0, 0])
        flat_a, flat_e = actual.reshape(-1), expected.reshape(-1)
        raise AssertionError(
            f"{what}: {int(differ.sum())} of {actual.numel()} elements differ; first at {i}: "
            f"{flat_a[i].item()!r} vs {flat_e[i].item()!r}"
        )


def flushed(t: torch.Tensor) -> torch.Tensor:
    """t with denormals replaced by zeros of the same sign, as the kernel computes them."""
    denormal = (t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)
    return torch.where(denormal, torch.zeros_like(t).copysign(t), t)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of a's dtype lie between a and b."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = bits(t).to(torch.int64)
        sign_bit = 1 << (8 * t.element_size() - 1)
        return torch.where(i < 0, -(i + sign_bit), i)

    return (ordered(a) - ordered(b)).abs()


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor with every NaN written as one NaN: equal means equal by the kernels' contract, every
    non-NaN bit (signed zeros included) and NaN exactly where NaN is. A NaN's payload is the hardware's own (0xFFC00000
    for 0/0 on x86-64, 0x7FC00000 on AArch64, 0x7FFFFFFF on NVIDIA GPUs) and means nothing."""
    t = t.detach().reshape(-1)
    if t.is_floating_point():
        t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view(torch.uint8).clone()


def printed_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, str]]:
    """Parses torch's Optimizer.__repr__: a line per group, then `    key: value` sorted by key;
    a blank line between groups."""
    lines = repr(optimizer).splitlines()
    assert lines[0] == f"{type(optimizer).__name__} (" and lines[-1] == ")"
    groups: list[dict[str, str]] = []
    for line in lines[1:-1]:
        if not line:
            assert groups and groups[-1]
        elif line.startswith("Parameter Group "):
            assert line == f"Parameter Group {len(groups)}"
            groups.append({})
        else:
            key, value = line.strip().split(": ", 1)
            groups[-1][key] = value
    return groups


def failing_unless_checking(adam_step: Callable[..., None]) -> Callable[..., None]:
    """``adam_step`` whose checks run and whose kernel calls raise: a kernel failing after the checks passed."""

    def failing(*args: Any, check_only: bool = False, **kwargs: Any) -> None:
        if not check_only:
            raise RuntimeError("simulated kernel failure")
        adam_step(*args, check_only=True, **kwargs)

    return failing
