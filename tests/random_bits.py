"""The kernel's random bits in plain Python and torch, written from its definition (ops.cpp's
key, csrc/kernels/random_bits.h's hash, quant8.h's code stream), for exact checks of stochastic
rounding."""

from __future__ import annotations

import torch
from torch import Tensor

_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B
_CODE_STREAM = 0x6A09E667


def _mix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def rng_key(seed: int, step: int, high_counter: int) -> int:
    k = _mix64(seed & _M64)
    k = _mix64(k ^ (step & _M64))
    return _mix64(k ^ high_counter) & _M32


def _times(x: Tensor, k: int) -> Tensor:
    """x * k mod 2^32 for x < 2^32 without leaving int64: by 16-bit halves."""
    return (((((x >> 16) * k) & 0xFFFF) << 16) + (x & 0xFFFF) * k) & _M32


def lowbias32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _times(x, _MIX1)
    x = x ^ (x >> 15)
    x = _times(x, _MIX2)
    return x ^ (x >> 16)


def code_bits(seed: int, step: int, counters: Tensor) -> tuple[Tensor, Tensor]:
    """16 random bits for each element's exp_avg code and 16 for its root's, for elements at
    ``counters`` (int64) of a step: hash(low 32 bits of the counter + code key)."""
    bits = torch.empty_like(counters)
    high = counters >> 32
    for h in high.unique().tolist():
        key = int(lowbias32(torch.tensor(rng_key(seed, step, h) ^ _CODE_STREAM)))
        at = high == h
        bits[at] = lowbias32(((counters[at] & _M32) + key) & _M32)
    return bits & 0xFFFF, bits >> 16
