"""How Adam's moments are kept (``state_precision``), shared by CPUAdam and the offload optimizer:
the names, their dtypes, and conversions of saved moments between them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import quant8

__all__ = [
    "MOMENTS",
    "SCALES",
    "STATE_PRECISIONS",
    "check_saved_moments",
    "converted_moments",
    "resolved_precision",
    "state_dtype",
]

MOMENTS = ("exp_avg", "exp_avg_sq")
SCALES = "state_scales"  # 8-bit moments: float32 [2, blocks], each moment's scale per block
STATE_PRECISIONS = ("fp32", "bf16", "8bit")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}


def state_dtype(precision: str) -> torch.dtype:
    """The dtype the moments are stored in (uint8: 8-bit codes with block scales)."""
    return _DTYPES[precision]


def resolved_precision(owner: str, state_precision: str | None, fp32_optimizer_states: bool | None) -> str:
    """``state_precision``, or what DeepSpeed's ``fp32_optimizer_states`` shorthand means; they must agree."""
    if state_precision is not None and state_precision not in STATE_PRECISIONS:
        raise ValueError(f"{owner}: state_precision must be one of {STATE_PRECISIONS}, got {state_precision!r}")
    implied = None if fp32_optimizer_states is None else ("fp32" if fp32_optimizer_states else "bf16")
    if state_precision is not None and implied is not None and state_precision != implied:
        raise ValueError(
            f"{owner}: fp32_optimizer_states={fp32_optimizer_states} means state_precision={implied!r}, but "
            f"state_precision={state_precision!r} was given; pass only state_precision"
        )
    return state_precision or implied or "fp32"


def check_saved_moments(where: str, saved: dict[str, Tensor], shape: tuple[int, ...]) -> None:
    """Refuses saved moments that do not fit a param of ``shape`` or that hold no usable numbers, by name,
    before anything is loaded: a wrong shape would fail at the next step with the old state gone, and
    a NaN or negative second moment would train NaN."""
    present = [k for k in (*MOMENTS, SCALES) if k in saved]
    if not present:
        return
    missing = [k for k in MOMENTS if k not in saved]
    if missing:
        raise ValueError(f"{where}: the saved state has {', '.join(present)} but no {', '.join(missing)}")
    numel = math.prod(shape)
    eight_bit = saved["exp_avg"].dtype == torch.uint8
    if eight_bit and SCALES not in saved:
        raise ValueError(
            f"{where}: 8-bit (uint8) moments without their {SCALES} or block exponents: the codes mean nothing "
            "without them. A checkpointer that rebuilds the state dict from the keys of optimizer.state (as "
            "torchtitan's does) drops the exponents CPUAdam saves for DTensor params; load through "
            "torch.distributed.checkpoint's get_state_dict/set_state_dict, or use state_precision='bf16' there"
        )
    if not eight_bit and SCALES in saved:
        raise ValueError(f"{where}: float moments come without {SCALES}, which only 8-bit (uint8) moments have")
    for name in MOMENTS:
        t = saved[name]
        if not isinstance(t, Tensor) or t.numel() != numel or (t.dim() > 1 and tuple(t.shape) != tuple(shape)):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} has shape {got}, its param {tuple(shape)}: not this param's state")
    if eight_bit:
        scales = saved[SCALES]
        blocks = quant8.blocks(numel)
        if scales.dtype != torch.float32 or tuple(scales.shape) != (2, blocks):
            raise ValueError(
                f"{where}: {SCALES} is {scales.dtype} {tuple(scales.shape)}; it must be float32 (2, {blocks})"
            )
        if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
            raise ValueError(f"{where}: {SCALES} holds a non-finite or non-positive scale: the state was damaged")
        return
    if not bool(torch.isfinite(saved["exp_avg"]).all()):
        raise ValueError(f"{where}: exp_avg holds a non-finite value; the run it was saved from had diverged")
    sq = saved["exp_avg_sq"]
    if not bool(torch.isfinite(sq).all()) or bool((sq < 0).any()):
        raise ValueError(f"{where}: exp_avg_sq holds a non-finite or negative value, which no Adam step can make")


def converted_moments(saved: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """The saved moments (float, or 8-bit codes with their scales) in ``dtype``, as new tensors."""
    if SCALES in saved:
        if dtype == torch.uint8:
            return {k: v.to(device=device, copy=True) for k, v in saved.items()}
        floats = quant8.dequantize_moments(saved["exp_avg"], saved["exp_avg_sq"], saved[SCALES])
        return {k: v.to(device=device, dtype=dtype) for k, v in zip(MOMENTS, floats)}
    if dtype == torch.uint8 and all(k in saved for k in MOMENTS):
        codes = quant8.quantize_moments(saved["exp_avg"].cpu(), saved["exp_avg_sq"].cpu())
        return {k: v.to(device=device) for k, v in zip((*MOMENTS, SCALES), codes)}
    return {k: v.to(device=device, dtype=dtype, copy=True) for k, v in saved.items()}
