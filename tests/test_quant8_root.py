"""The 8-bit state conversion's square root is correctly rounded, as the kernel's is, on every machine.

The reference is exact: a float32 r is the correctly rounded root of x where x lies between the squares of the
midpoints from r to its neighbours, checked in rational arithmetic (no float square root decides it).
"""

from __future__ import annotations

from fractions import Fraction

import torch

from cpu_adam import quant8

_UP, _DOWN = torch.tensor(float("inf")), torch.tensor(0.0)


def _neighbour(r: float, toward: torch.Tensor) -> float:
    return float(torch.nextafter(torch.tensor(r, dtype=torch.float32), toward.to(torch.float32)))


def _correctly_rounded_root(x: float) -> float:
    """The float32 nearest to sqrt(x), found from any start by exact comparisons (no tie can occur: the square of
    a midpoint has more significant bits than a float32)."""
    exact = Fraction(x)
    r = float(torch.tensor(x, dtype=torch.float32).sqrt())
    while (Fraction(r) + Fraction(_neighbour(r, _UP))) ** 2 / 4 < exact:
        r = _neighbour(r, _UP)
    while r > 0 and (Fraction(r) + Fraction(_neighbour(r, _DOWN))) ** 2 / 4 > exact:
        r = _neighbour(r, _DOWN)
    return r


def _reference_roots(values: torch.Tensor) -> torch.Tensor:
    return torch.tensor([_correctly_rounded_root(x) for x in values.tolist()], dtype=torch.float32)


def _float32_everywhere(count: int) -> torch.Tensor:
    """Non-negative finite float32 values with uniformly drawn bit patterns (every binade, subnormals included)."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(0, 0x7F800000, (count,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0.0, 1.0, 2.0, 0.25, torch.finfo(torch.float32).max, 2.0**-149, 2.0**-126])
    return torch.cat([patterns.view(torch.float32), edges])


def test_the_root_is_correctly_rounded_over_every_binade():
    values = _float32_everywhere(20000)
    differ = int((quant8.root_of(values).view(torch.int32) != _reference_roots(values).view(torch.int32)).sum())
    assert differ == 0, f"{differ} of {values.numel()} roots are not correctly rounded"


def _near_code_midpoints() -> torch.Tensor:
    """Second moments whose roots lie within a few ulps of a midpoint between two root codes (scale 1), where one
    ulp of the root decides the code: each block starts with v = 1 (root 1: the scale is 1)."""
    table = quant8._magnitudes(4).to(torch.float32)
    midpoints = ((table[1:] + table[:-1]) / 2)[table[:-1] > 0]
    squares = (midpoints.double() ** 2).to(torch.float32)
    bits = squares.view(torch.int32)[:, None] + torch.arange(-4, 5, dtype=torch.int32)
    candidates = bits.reshape(-1).view(torch.float32)
    per_block = quant8.BLOCK - 1
    blocks = -(-candidates.numel() // per_block)
    padded = torch.cat([candidates, torch.zeros(blocks * per_block - candidates.numel())]).view(blocks, per_block)
    return torch.cat([torch.ones(blocks, 1), padded], dim=1).reshape(-1)


def test_converted_8bit_codes_are_those_of_the_correctly_rounded_root():
    v = _near_code_midpoints()
    _, root_codes, scales = quant8.quantize_moments(torch.zeros_like(v), v)
    expected_codes, expected_scales = quant8.encode(_reference_roots(v), root=True)
    assert torch.equal(scales[1], expected_scales)
    differ = int((root_codes != expected_codes).sum())
    assert differ == 0, f"{differ} of {v.numel()} codes are not those of the correctly rounded root"
