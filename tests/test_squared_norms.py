"""``ops.squared_norms``, the clip norm's pass: every ISA gives the scalar kernel's bits, the sums are the float64
sums of the squares to float64 rounding, and what it cannot take is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from conftest import vector_isas

from cpu_adam import ops

SIZES = [1, 31, 32, 33, 1000, (1 << 16) - 1, (1 << 16) + 7, 3 * (1 << 16)]  # lanes' tails, runs' ends


def tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=g) * 10.0 ** (i % 7 - 3)).to(dtype) for i, n in enumerate(SIZES)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("isa", vector_isas())
def test_every_isa_gives_the_scalar_sums(dtype: torch.dtype, isa: str) -> None:
    xs = tensors(dtype)
    with ops.force_isa("scalar"):
        expected = ops.squared_norms(xs)
    with ops.force_isa(isa):
        got = ops.squared_norms(xs)
    assert torch.equal(got.view(torch.int64), expected.view(torch.int64)), f"{isa}: {got - expected}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_sums_are_float64_sums_of_the_squares(dtype: torch.dtype) -> None:
    xs = tensors(dtype)
    exact = torch.stack([x.double().square().sum() for x in xs])
    got = ops.squared_norms(xs)
    assert got.dtype == torch.float64 and got.shape == (len(xs),)
    assert ((got - exact).abs() <= 1e-13 * exact).all(), (got / exact - 1).abs().max()


def test_non_finite_values_and_layouts() -> None:
    strided = torch.arange(40, dtype=torch.float32).reshape(8, 5).t()  # not contiguous: read as it is laid out
    sums = ops.squared_norms([torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")]), strided, torch.ones(0)])
    assert sums[0] == float("inf") and sums[1].isnan() and sums[3] == 0
    assert sums[2] == float(torch.arange(40, dtype=torch.float64).square().sum())


def test_other_dtypes_are_refused_naming_them() -> None:
    with pytest.raises(TypeError, match=r"tensor 1 is Half; float32 and bfloat16 only"):
        ops.squared_norms([torch.ones(3), torch.ones(3, dtype=torch.float16)])
