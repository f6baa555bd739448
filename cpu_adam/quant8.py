"""8-bit Adam moments: the code maps, written once in plain torch.

The kernel (``csrc/kernels/quant8.h``) computes the codes with integer operations on float32
bits; this module finds them in a decode table in float64 (given the kernel's random bits, the
same codes), so the tests can use it as an independent reference, and the optimizers use it to
convert state dicts between precisions (rounding to nearest).

Per block of 256 elements, each moment has a float32 scale: the power of two 2^k at or below the
block's largest magnitude, or the next one where the largest lies above the largest code (so that
no value saturates), at least 2^-112 (1 for an all-zero block, NaN for a block holding a
non-finite value, which then decodes to NaN). x = |value| / scale lies in [0, 2) and is exact.
A code holds x as a tiny float: a 4-bit exponent field e (bias 15) and an M-bit mantissa f,
x = 2^(e-15) (1 + f/2^M) for e > 0, f 2^-(14+M) for e = 0, saturating at the largest code.

The optimizer step rounds stochastically: up to the next code with probability equal to the
fraction of the code step below x, counted in 2^-16 steps of 16 random bits per value, so that
the moments follow their small, steady changes on average (round-to-nearest would freeze a slow
second moment: with beta2 = 0.999 sqrt(v) moves about 0.05% a step, half a code step is 1.6-3.1%).
``encode`` does the same given those bits, and rounds to nearest (ties to even) without them, as
the state dict conversions do.

- ``exp_avg``: sign in bit 7, M = 3 (largest x 1.875).
- ``exp_avg_sq`` is stored as its root u = sqrt(v), unsigned, M = 4 (largest x 1.9375): the
  step needs sqrt(v) anyway, the root halves the range to cover, and a positive u is never
  rounded to code 0 (a zero second moment would make the update m / eps).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["BLOCK", "blocks", "decode", "dequantize_moments", "encode", "quantize_moments", "root_of"]

BLOCK = 256
_AVG_MANTISSA = 3
_ROOT_MANTISSA = 4
_SMALLEST_SCALE = 2.0**-112  # its normal codes hold every float32 the step stores (none below 2^-126)
_RANDOM_STEPS = 1 << 16


def blocks(numel: int) -> int:
    """How many scale blocks a tensor of ``numel`` elements has."""
    return (numel + BLOCK - 1) // BLOCK


def _magnitudes(mantissa: int) -> Tensor:
    """x for every magnitude code, ascending, in float64 (exact)."""
    codes = torch.arange(16 << mantissa, dtype=torch.float64)
    e, f = torch.div(codes, 1 << mantissa, rounding_mode="floor"), codes % (1 << mantissa)
    normal = torch.pow(2.0, e - 15) * (1 + f / (1 << mantissa))
    return torch.where(e > 0, normal, f * 2.0 ** -(14 + mantissa))


def _blocked(values: Tensor) -> Tensor:
    flat = values.detach().reshape(-1).to(torch.float64)
    padded = torch.zeros(blocks(flat.numel()) * BLOCK, dtype=torch.float64)
    padded[: flat.numel()] = flat
    return padded.view(-1, BLOCK)


def _scales(blocked: Tensor, mantissa: int) -> Tensor:
    largest = blocked.abs().amax(dim=1)
    _, exponent = torch.frexp(largest)  # largest = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = exponent - 1  # largest = x * 2^exponent, x in [1, 2)
    above_the_largest_code = largest / torch.pow(2.0, exponent.to(torch.float64)) > 2 - 2.0**-mantissa
    exponent = torch.where(above_the_largest_code & (exponent < 127), exponent + 1, exponent)
    scale = torch.pow(2.0, exponent.to(torch.float64)).clamp(min=_SMALLEST_SCALE)
    scale = torch.where(largest == 0, torch.ones_like(scale), scale)
    return torch.where(blocked.isfinite().all(dim=1), scale, torch.full_like(scale, math.nan))


def _neighbours(x: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """Indices of the entries of ``table`` at or below x and next above it (the top one twice)."""
    top = table.numel() - 1
    lo = (torch.searchsorted(table, x.contiguous(), right=True) - 1).clamp(0, top)
    return lo, (lo + 1).clamp(max=top)


def _nearest(x: Tensor, table: Tensor) -> Tensor:
    """Index of the entry of ``table`` nearest to x (ties to the even index; saturating)."""
    lo, hi = _neighbours(x, table)
    below, above = x - table[lo], table[hi] - x
    take_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def _stochastic(x: Tensor, table: Tensor, random16: Tensor) -> Tensor:
    """Index of the entry of ``table`` at or below x, plus one where ``random16`` (uniform in
    [0, 2^16)) plus the fraction of the step to the next entry, in 2^-16 units, reaches 2^16."""
    lo, hi = _neighbours(x, table)
    step = torch.where(hi > lo, table[hi] - table[lo], 1.0)  # at the top x saturates
    fraction = torch.floor((x - table[lo]) / step * _RANDOM_STEPS)  # exact: steps are powers of two
    return torch.where(random16 + fraction >= _RANDOM_STEPS, hi, lo)


def encode(values: Tensor, *, root: bool, random16: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Codes (uint8, flat, padded to whole blocks) and float32 scales of ``values``.

    ``root``: the values are roots sqrt(v) (non-negative, unsigned map), else exp_avg.
    ``random16``: 16 random bits per value (integers in [0, 2^16), shaped like ``values``) to
    round stochastically as the optimizer step does; without them, to nearest.
    """
    mantissa = _ROOT_MANTISSA if root else _AVG_MANTISSA
    blocked = _blocked(values)
    scale = _scales(blocked, mantissa)
    table = _magnitudes(mantissa)
    x = (blocked.abs() / scale[:, None]).nan_to_num(nan=0.0)
    codes = _nearest(x, table) if random16 is None else _stochastic(x, table, _blocked(random16).long())
    if root:
        codes = torch.where((blocked != 0) & (codes == 0), torch.ones_like(codes), codes)
    else:
        codes = codes | (torch.signbit(blocked).to(torch.int64) << 7)
    codes = torch.where(scale.isnan()[:, None], torch.zeros_like(codes), codes)
    return codes.to(torch.uint8).reshape(-1), scale.to(torch.float32)


def decode(codes: Tensor, scale: Tensor, *, root: bool) -> Tensor:
    """Values (float64, flat, whole blocks) of flat ``codes`` with per-block ``scale``."""
    c = codes.reshape(-1, BLOCK).to(torch.int64)
    s = scale.to(torch.float64)[:, None]
    if root:
        return (_magnitudes(_ROOT_MANTISSA)[c] * s).reshape(-1)
    magnitude = _magnitudes(_AVG_MANTISSA)[c & 0x7F] * s
    return torch.where(c >= 0x80, -magnitude, magnitude).reshape(-1)


# Conversions go this many elements at a time: the float64 reference costs tens of bytes per
# element, which for a whole offloaded group would be many times its state.
_CHUNK = BLOCK << 12


def root_of(exp_avg_sq: Tensor) -> Tensor:
    """sqrt(v) of float32 ``exp_avg_sq``, correctly rounded to float32, as the kernel's square root rounds.

    torch's float32 sqrt on the CPU is not correctly rounded (1 ulp off for 17% of inputs with torch 2.13), so
    converted states would differ between machines. The float64 root of a float32 rounded once to float32 is
    (float64 holds more than 2 * 24 + 2 bits, so rounding twice gives the one rounding of the exact root)."""
    return exp_avg_sq.to(torch.float32).to(torch.float64).sqrt().to(torch.float32)


def quantize_moments(exp_avg: Tensor, exp_avg_sq: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(exp_avg codes, exp_avg_sq codes, scales): codes uint8 shaped like the moments, scales
    float32 [2, blocks]. The root of exp_avg_sq is taken in float32 (``root_of``), as the kernel does."""
    avg, sq = exp_avg.detach().reshape(-1), exp_avg_sq.detach().reshape(-1)
    n, shape = avg.numel(), exp_avg.shape
    avg_codes, root_codes = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    scales = torch.empty(2, blocks(n), dtype=torch.float32)
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        codes, scale = encode(avg[lo:hi], root=False)
        avg_codes[lo:hi], scales[0, lo // BLOCK : blocks(hi)] = codes[: hi - lo], scale
        codes, scale = encode(root_of(sq[lo:hi]), root=True)
        root_codes[lo:hi], scales[1, lo // BLOCK : blocks(hi)] = codes[: hi - lo], scale
    return avg_codes.reshape(shape), root_codes.reshape(shape), scales


def dequantize_moments(avg_codes: Tensor, root_codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """(exp_avg, exp_avg_sq) in float32 from 8-bit codes and their [2, blocks] scales; v = u * u
    in float32, as the kernel squares the root."""
    avg_in, root_in = avg_codes.detach().reshape(-1).cpu(), root_codes.detach().reshape(-1).cpu()
    n, shape = avg_in.numel(), avg_codes.shape
    scales = scales.cpu()
    avg, sq = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        block_scales = scales[:, lo // BLOCK : blocks(hi)]
        padded = torch.zeros(2, block_scales.shape[1] * BLOCK, dtype=torch.uint8)
        padded[0, : hi - lo], padded[1, : hi - lo] = avg_in[lo:hi], root_in[lo:hi]
        avg[lo:hi] = decode(padded[0], block_scales[0], root=False)[: hi - lo]
        root = decode(padded[1], block_scales[1], root=True)[: hi - lo].to(torch.float32)
        sq[lo:hi] = root * root
    return avg.reshape(shape), sq.reshape(shape)
