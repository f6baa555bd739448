"""A param group's part of CPUAdam's step: its params' tensors as the kernel steps them (the pieces of DTensor
shards, ``fsdp2.places``), their random bits' counters, and the group's hyper-parameters, in one GroupStep, or one
per unit of the step behind the forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import ops
from ._compiled_step import GroupStep
from .fsdp2 import places


def group_steps(
    index: int,
    group: dict[str, Any],
    tensors: tuple[list[Tensor], ...],
    indices: list[int],
    shard_start: Callable[[Tensor], int],
    clip: float,
    unit_of: Callable[[Tensor], int] | None,
) -> dict[int, GroupStep]:
    """``tensors``: the local params, grads, moments, step counts and 8-bit scales of the group's params at
    ``indices`` (those with grads, as ``CPUAdam._init_group`` gives them); one GroupStep per unit (0: all)."""
    eight_bit = group["state_precision"] == "8bit"
    # Random bits (bf16 param stores, 8-bit codes): each param at its place in the group's counter
    # space, grad or not, and each element of a DTensor shard at its place in the whole param.
    rounded = group["stochastic_rounding"]
    random_bits = [eight_bit or (rounded and p.dtype == torch.bfloat16) for p in group["params"]]
    counters = ops.back_to_back(group["params"], ops.group_counter_base(index)) if any(random_bits) else None
    by_unit: dict[int, tuple[list[Any], ...]] = {}
    for n, i in enumerate(indices):
        p = group["params"][i]
        unit = unit_of(p) if unit_of is not None else 0
        params, grads, exp_avgs, exp_avg_sqs, steps, scales, offsets, write_backs = by_unit.setdefault(
            unit, tuple([] for _ in range(8))
        )
        parts = places.pieces(
            *(each[n] for each in tensors[:4]),
            tensors[5][n] if eight_bit else None,
            counter=counters[i] if counters else 0,
            start=shard_start(p),
            random_bits=random_bits[i],
        )
        for k, part in enumerate(parts):
            params.append(part.param)
            grads.append(part.grad)
            exp_avgs.append(part.exp_avg)
            exp_avg_sqs.append(part.exp_avg_sq)
            steps.append(tensors[4][n] if k == 0 else tensors[4][n].clone())  # counted once
            if part.scales is not None:
                scales.append(part.scales)
            offsets.append(part.counter)
            write_backs.extend(part.write_backs)
    beta1, beta2 = group["betas"]
    hyper = dict(
        lr=group["lr"],
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        adamw_mode=bool(group["decoupled_weight_decay"]),
        bias_correction=bool(group["bias_correction"]),
        grad_scale=-clip if group.get("maximize") else clip,  # maximize: the step climbs the grad
        stochastic_rounding=bool(group["stochastic_rounding"]),
        seed=int(group["seed"]),
    )
    return {
        unit: GroupStep(
            *lists[:5],
            **hyper,
            counter_offsets=lists[6] if any(random_bits) else [],
            state_scales=lists[5],
            write_backs=lists[7],
        )
        for unit, lists in by_unit.items()
    }
