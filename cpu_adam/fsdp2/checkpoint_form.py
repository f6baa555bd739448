"""8-bit moments of DTensor params (FSDP2) in state dicts, so that ``torch.distributed.checkpoint``
reshards them.

A shard's block scales follow the whole param's blocks (``places.py``), but a block cut by a shard
boundary has a scale on each side, so no [2, blocks] tensor of the whole param holds them. The state
dict holds instead, for each moment, each element's block scale as its power of two: an int8 DTensor
shaped and sharded like the param (``EXPONENTS``; every scale is a power of two, 2^-112 to 2^127, or
NaN for a block that held a non-finite value). DCP reshards it as it reshards the codes. On loading,
a block whose elements carry one exponent keeps its codes and scale exactly; a block whose elements
carry several (cut where it was saved, whole where it is loaded) is encoded again to nearest from its
values (``quant8.encode``). In memory the shard keeps its [2, blocks] scales (2 bytes a param less).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from .. import quant8
from .._precision import MOMENTS, SCALES
from .places import block_sizes, element_scales, head_size, is_dtensor, local

__all__ = ["EXPONENTS", "check_exponents", "exponents_of", "loaded_moments", "shaped_like", "with_exponents"]

EXPONENTS = ("exp_avg_block_exponent", "exp_avg_sq_block_exponent")
_NAN = -128  # the exponent of a NaN scale (a block that held a non-finite value)
_SMALLEST, _LARGEST = -112, 127


def with_exponents(
    saved: dict[str, Any],
    params: list[Tensor],
    state: Mapping[Tensor, dict[str, Any]],
    start_of: Callable[[Tensor], int],
) -> dict[str, Any]:
    """torch's optimizer state dict ``saved`` (its entries indexed as ``params``) with the 8-bit moments' block
    scales of DTensor params as each element's exponents, int8 DTensors sharded like the param."""
    for index, p in enumerate(params):
        own = state.get(p)
        if not own or SCALES not in own or not is_dtensor(own["exp_avg"]):
            continue
        exponents = exponents_of(own[SCALES], local(p).numel(), start_of(p))
        entry = {k: v for k, v in saved["state"][index].items() if k != SCALES}
        for name, each in zip(EXPONENTS, exponents):
            entry[name] = shaped_like(p, each)
        saved["state"][index] = entry
    return saved


def shaped_like(p: Tensor, values: Tensor) -> Tensor:
    """``values`` (a shard's, any shape of its size) as a tensor like ``p``: a DTensor sharded as it is."""
    if not is_dtensor(p):
        return values.reshape(p.shape)
    shaped = torch.empty_like(p, dtype=values.dtype)
    shaped.to_local().copy_(values.reshape(shaped.to_local().shape))
    return shaped


def exponents_of(scales: Tensor, numel: int, start: int) -> Tensor:
    """Each element's block-scale exponents, int8 [2, numel], from a shard's [2, blocks] scales."""
    per_element = element_scales(scales, numel, start)
    _, exponent = torch.frexp(per_element)  # 2^k = 0.5 * 2^(k + 1)
    return torch.where(per_element.isnan(), _NAN, exponent - 1).to(torch.int8)


def check_exponents(where: str, saved: dict[str, Tensor], shape: tuple[int, ...]) -> None:
    """Refuses exponents that do not fit a param of ``shape`` or that no scale has (a damaged state)."""
    for name in EXPONENTS:
        t = saved.get(name)
        if not isinstance(t, Tensor) or t.dtype != torch.int8 or tuple(t.shape) != tuple(shape):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} is {got}; 8-bit moments of a shard need int8 exponents shaped {shape}")
        valid = ((t >= _SMALLEST) & (t <= _LARGEST)) | (t == _NAN)
        if not bool(valid.all()):
            raise ValueError(f"{where}: {name} holds an exponent no block scale has: the state was damaged")


def loaded_moments(saved: dict[str, Tensor], dtype: torch.dtype, start: int) -> dict[str, Tensor]:
    """A shard's saved moments (local tensors: float, 8-bit with [2, blocks] ``SCALES`` of a whole
    param, or 8-bit with ``EXPONENTS``) as this optimizer keeps them: ``dtype`` moments, and for
    uint8 their [2, blocks] scales in the blocks of a shard from element ``start``."""
    if not all(k in saved for k in MOMENTS):
        return {}
    m, v = (saved[k].detach().reshape(-1).cpu() for k in MOMENTS)
    shape = saved["exp_avg"].shape
    if EXPONENTS[0] in saved:
        exponents = torch.stack([saved[k].detach().reshape(-1).cpu() for k in EXPONENTS])
        if dtype == torch.uint8:
            codes = _requantized(m, v, exponents, start)
            return {"exp_avg": codes[0].reshape(shape), "exp_avg_sq": codes[1].reshape(shape), SCALES: codes[2]}
        m, v = _values(m, v, exponents)
    elif SCALES in saved:
        m, v = quant8.dequantize_moments(m, v, saved[SCALES])
    if dtype != torch.uint8:
        return {"exp_avg": m.to(dtype).reshape(shape), "exp_avg_sq": v.to(dtype).reshape(shape)}
    codes = _quantized(m, v, start)
    return {"exp_avg": codes[0].reshape(shape), "exp_avg_sq": codes[1].reshape(shape), SCALES: codes[2]}


def _decoded(codes: Tensor, exponents: Tensor, root: bool) -> Tensor:
    """Each element's value (float64) from its code and its block scale's exponent."""
    n = codes.numel()
    padded = torch.zeros(quant8.blocks(n) * quant8.BLOCK, dtype=torch.uint8)
    padded[:n] = codes
    x = quant8.decode(padded, torch.ones(quant8.blocks(n)), root=root)[:n]
    scale = torch.ldexp(torch.ones(n, dtype=torch.float64), exponents.to(torch.int64))
    return x * torch.where(exponents == _NAN, math.nan, scale)


def _values(m_codes: Tensor, u_codes: Tensor, exponents: Tensor) -> tuple[Tensor, Tensor]:
    """(exp_avg, exp_avg_sq) in float32; v = u * u in float32, as the kernel squares the root."""
    root = _decoded(u_codes, exponents[1], root=True).to(torch.float32)
    return _decoded(m_codes, exponents[0], root=False).to(torch.float32), root * root


def _requantized(m: Tensor, u: Tensor, exponents: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes and [2, blocks] scales in the shard's blocks: a block whose elements share an exponent
    keeps its codes; one whose do not is encoded again, to nearest, from its values."""
    sizes = torch.tensor(block_sizes(m.numel(), start), dtype=torch.int64)
    block_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes).expand(2, -1)
    wide = exponents.to(torch.int16)
    least = torch.full((2, sizes.numel()), _LARGEST, dtype=torch.int16).scatter_reduce(1, block_of, wide, "amin")
    most = torch.full((2, sizes.numel()), _NAN, dtype=torch.int16).scatter_reduce(1, block_of, wide, "amax")
    powers = torch.ldexp(torch.ones(2, sizes.numel()), least.to(torch.int32))
    scales = torch.where(least == _NAN, math.nan, powers)
    codes = (m.clone(), u.clone())
    bounds = [0, *sizes.cumsum(0).tolist()]
    for moment, b in (least != most).nonzero().tolist():  # blocks cut otherwise when saved: few
        lo, hi = bounds[b], bounds[b + 1]
        values = _decoded(codes[moment][lo:hi], exponents[moment, lo:hi], root=moment == 1)
        new_codes, scale = quant8.encode(values, root=moment == 1)
        codes[moment][lo:hi], scales[moment, b] = new_codes[: hi - lo], scale[0]
    return codes[0], codes[1], scales


def _quantized(m: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
    """Float moments as 8-bit codes (to nearest) in the blocks of a shard from element ``start``."""
    head = head_size(m.numel(), start, eight_bit=True)
    parts = [(lo, hi) for lo, hi in ((0, head), (head, m.numel())) if hi > lo]
    quantized = [quant8.quantize_moments(m[lo:hi], v[lo:hi]) for lo, hi in parts]
    if not quantized:
        return m.to(torch.uint8), v.to(torch.uint8), torch.ones(2, 0)
    return tuple(torch.cat(each, dim=-1) for each in zip(*quantized))  # type: ignore[return-value]
