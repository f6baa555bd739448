"""The offload optimizer's own options, checked where they are set."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["DEFAULT_BUCKET_SIZE", "check_options", "checked_max_grad_norm"]

OVERLAPS = ("none", "backward")  # when the CPU step runs: after backward, or during it (overlap.py)
DEFAULT_BUCKET_SIZE = 2**23  # elements: 16 MiB of bf16 grads per copy, far past PCIe's small-copy overheads


def checked_max_grad_norm(value: Any) -> float | None:
    # Checked on every assignment (a scheduler's, a loaded state dict's): a norm <= 0 would turn
    # descent into ascent or ignore the grads.
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"cpu_adam.OffloadOptimizer: max_grad_norm must be a finite number > 0, or None for no clipping; "
            f"got {value!r}"
        )
    return float(value)


def check_options(
    master_weights_dtype: torch.dtype, stochastic_rounding: bool, max_inflight_buckets: int, overlap: str
) -> None:
    if master_weights_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"master_weights_dtype must be torch.float32 or torch.bfloat16, got {master_weights_dtype}")
    if stochastic_rounding and master_weights_dtype != torch.bfloat16:
        raise ValueError("stochastic_rounding applies to bf16 master weights: pass master_weights_dtype=torch.bfloat16")
    if max_inflight_buckets < 1:
        raise ValueError(f"max_inflight_buckets must be at least 1, got {max_inflight_buckets}")
    if overlap not in OVERLAPS:
        raise ValueError(f"cpu_adam.OffloadOptimizer: overlap must be one of {OVERLAPS}, got {overlap!r}")
