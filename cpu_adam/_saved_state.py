"""Saved moments loaded into CPUAdam, for plain and DTensor params alike: the checks that refuse what
does not fit, and the conversion to the precision and the layout (a shard's blocks) kept."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._precision import MOMENTS, SCALES, STATE_PRECISIONS, check_saved_moments, converted_moments, state_dtype
from .fsdp2 import checkpoint_form, places
from .fsdp2.checkpoint_form import shaped_like

__all__ = ["check_precision", "check_saved", "converted", "split_moments"]


def check_saved(where: str, saved: dict[str, Tensor], p: Tensor, start: int) -> None:
    """Refuses saved moments (local tensors) that do not fit ``p``'s shard from element ``start`` of its
    whole param, or that hold no usable numbers."""
    shape = tuple(places.local(p).shape)
    if not any(name in saved for name in checkpoint_form.EXPONENTS):
        if SCALES in saved and places.head_size(math.prod(shape), start, eight_bit=True):
            raise ValueError(
                f"{where}: 8-bit moments with state_scales in blocks of the local tensor, but this shard "
                "starts inside a block of its whole param; save them with CPUAdam.state_dict() (through "
                "torch.distributed.checkpoint's get_state_dict), which gives each element's scale"
            )
        check_saved_moments(where, saved, shape)
        return
    checkpoint_form.check_exponents(where, saved, shape)
    for name in MOMENTS:
        t = saved.get(name)
        if not isinstance(t, Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != shape:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} is {got} beside block exponents; 8-bit codes are uint8 {shape}")


def converted(saved: dict[str, Tensor], p: Tensor, dtype: torch.dtype, start: int) -> dict[str, Tensor]:
    """Saved moments as the optimizer keeps them for ``p``: in ``dtype``, DTensors like it for a DTensor param."""
    if not places.is_dtensor(p) and not any(name in saved for name in checkpoint_form.EXPONENTS):
        return converted_moments(saved, dtype, p.device)
    local = {k: places.local(v) for k, v in saved.items()}
    moments = checkpoint_form.loaded_moments(local, dtype, start)
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


def split_moments(
    state_dict: dict[str, Any],
    params: list[Tensor],
    dtype_of: dict[int, torch.dtype],
    start_of: Callable[[Tensor], int],
) -> tuple[dict[int, dict[str, Tensor]], dict[str, Any]]:
    """The saved moments of each param (by id), checked and converted to the precision kept, and the state dict
    without them for torch's own load; every param checked before anything is returned, so that a refused load
    changes nothing."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    per_param = {i: s for i, s in state_dict["state"].items() if isinstance(s, dict)}
    moment_keys = (*MOMENTS, SCALES, *checkpoint_form.EXPONENTS)
    moments = {i: {k: v for k, v in s.items() if k in moment_keys} for i, s in per_param.items() if i in saved_ids}
    saved_precision = {i: g.get("state_precision") for g in state_dict["param_groups"] for i in g["params"]}
    loaded = {}
    for saved_id, p in zip(saved_ids, params):
        saved = moments.get(saved_id, {})
        where = f"CPUAdam.load_state_dict: the state of param {saved_id}"
        start = start_of(p)
        check_precision(where, saved, saved_precision.get(saved_id))
        check_saved(where, {k: places.local(v) for k, v in saved.items()}, p, start)
        if saved:
            loaded[id(p)] = converted(saved, p, dtype_of[id(p)], start)
    # Steps are cloned: torch's load keeps the saved step tensors, which a live
    # optimizer that produced them would go on incrementing in place.
    without_moments = {
        "state": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items() if k not in moment_keys}
            if i in per_param
            else s
            for i, s in state_dict["state"].items()
        },
        "param_groups": state_dict["param_groups"],
    }
    for i in per_param:
        saved = without_moments["state"][i]
        if "step" in saved and not torch.is_tensor(saved["step"]):  # torch < 1.12 and DeepSpeed save a number
            saved["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32)
    return loaded, without_moments
