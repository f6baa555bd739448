"""Saved moments loaded into CPUAdam, for plain and DTensor params alike: the checks that refuse what
does not fit, and the conversion to the precision and the layout (a shard's blocks) kept."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import shard_state, shards
from ._precision import MOMENTS, SCALES, STATE_PRECISIONS, check_saved_moments, converted_moments, state_dtype

__all__ = ["check_precision", "check_saved", "converted", "shaped_like"]


def check_saved(where: str, saved: dict[str, Tensor], p: Tensor, start: int) -> None:
    """Refuses saved moments (local tensors) that do not fit ``p``'s shard from element ``start`` of its
    whole param, or that hold no usable numbers."""
    shape = tuple(shards.local(p).shape)
    if not any(name in saved for name in shard_state.EXPONENTS):
        if SCALES in saved and shards.head_size(math.prod(shape), start, eight_bit=True):
            raise ValueError(
                f"{where}: 8-bit moments with state_scales in blocks of the local tensor, but this shard "
                "starts inside a block of its whole param; save them with CPUAdam.state_dict() (through "
                "torch.distributed.checkpoint's get_state_dict), which gives each element's scale"
            )
        check_saved_moments(where, saved, shape)
        return
    shard_state.check_exponents(where, saved, shape)
    for name in MOMENTS:
        t = saved.get(name)
        if not isinstance(t, Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != shape:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} is {got} beside block exponents; 8-bit codes are uint8 {shape}")


def converted(saved: dict[str, Tensor], p: Tensor, dtype: torch.dtype, start: int) -> dict[str, Tensor]:
    """Saved moments as the optimizer keeps them for ``p``: in ``dtype``, DTensors like it for a DTensor param."""
    if not shards.is_dtensor(p) and not any(name in saved for name in shard_state.EXPONENTS):
        return converted_moments(saved, dtype, p.device)
    local = {k: shards.local(v) for k, v in saved.items()}
    moments = shard_state.loaded_moments(local, dtype, start)
    return {k: shaped_like(p, v) if k in MOMENTS else v for k, v in moments.items()}


def check_precision(where: str, saved: dict[str, Tensor], precision: str | None) -> None:
    """Refuses moments whose dtype is not the precision their group was saved with: cast after saving, as
    torch.distributed.checkpoint casts a checkpoint into a state dict of another precision."""
    if precision is None or "exp_avg" not in saved or precision not in STATE_PRECISIONS:
        return
    dtype = saved["exp_avg"].dtype
    if dtype != state_dtype(precision):
        raise ValueError(
            f"{where}: its group was saved with state_precision={precision!r}, but the moments are {dtype}: they "
            "were cast after saving (torch.distributed.checkpoint loads a checkpoint into the state dict of an "
            f"optimizer of another precision so). Build the optimizer with state_precision={precision!r} to resume "
            "this checkpoint, then convert by loading its state_dict() into one of the precision you want"
        )


def shaped_like(p: Tensor, local: Tensor) -> Tensor:
    """``local`` (a shard's values, any shape of its size) as a tensor like ``p``: a DTensor sharded as it is."""
    if not shards.is_dtensor(p):
        return local.reshape(p.shape)
    shaped = torch.empty_like(p, dtype=local.dtype)
    shaped.to_local().copy_(local.reshape(shaped.to_local().shape))
    return shaped
