"""Handing a model built on the CPU or on the meta device over to the offload optimizer's device.

``OffloadOptimizer(params, device=...)`` takes params that are not on the device yet. A param on
the CPU (any float dtype) gives its values to the host master weights first, at full precision
(an fp32 model keeps fp32 masters, not bf16-rounded ones), and then moves to the device as bf16,
one param at a time: the device never holds more than the bf16 weights, and the host lets go of
each CPU tensor as it moves. A param on the meta device is given bf16 storage on the device
filled with NaN; its weights must be written (``model.load_state_dict(...)``, an init, also
through ``p.data``) before the first step, which checks that no such param is still all NaN.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .layout import FlatLayout
from .params import ModelSide
from .store import Store
from .world import World

__all__ = ["check_sources", "hand_over", "target_device"]


def target_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_sources(params: list[Tensor], device: torch.device) -> None:
    on_meta = [p.is_meta for p in params]
    if any(on_meta) and not all(on_meta):
        raise RuntimeError(
            "cpu_adam.OffloadOptimizer(device=...): some params are on the meta device and some are not; build the "
            "whole model on the meta device (its weights loaded after the optimizer is built), or none of it"
        )
    for p in params:
        if p.is_meta:
            continue
        if not p.is_floating_point():
            raise TypeError(f"cpu_adam.OffloadOptimizer: a parameter of shape {tuple(p.shape)} is {p.dtype}")
        if p.device.type != "cpu" and p.device != device:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer(device={device}): a parameter is on {p.device}; params handed over must "
                f"be on the CPU, the meta device or {device} already"
            )


def hand_over(side: ModelSide, layouts: list[FlatLayout | None], store: Store, world: World) -> None:
    """Moves every param to the side's device as bf16, filling the masters from the CPU values.

    Keeps the params that came from the meta device in ``side.unwritten``, for the check that
    their weights were written before the first step.
    """
    for g, layout in enumerate(layouts):
        if layout is None:
            continue
        segments: dict[int, list[tuple[slice, slice]]] = {}
        for b in range(len(layout.buckets)):
            for i, part, host in layout.piece_segments(b):
                segments.setdefault(i, []).append((part, host))
        for i, p in enumerate(side.params[g]):
            if p.is_meta:
                _replace_storage(p, torch.full(p.shape, math.nan, dtype=torch.bfloat16, device=side.device))
                side.unwritten.append(p)
                continue
            values = world.rank0_values(p.detach())  # ranks initialised with other seeds would train a patchwork
            flat = values.reshape(-1)
            for part, host in segments.get(i, []):
                store.write_master(g, host, flat[part])
            _replace_storage(p, values.to(device=side.device, dtype=torch.bfloat16).contiguous())
        side.synced[g] = not side.unwritten
        side.note_versions(g)


def _replace_storage(p: Tensor, new: Tensor) -> None:
    with torch.no_grad():
        if torch._has_compatible_shallow_copy_type(p, new):
            p.data = new
        else:  # meta to a real device: swap the whole tensor, keeping the Parameter object
            swapped = torch.nn.Parameter(new, requires_grad=p.requires_grad)
            swapped.__dict__.update(p.__dict__)
            torch.utils.swap_tensors(p, swapped)
