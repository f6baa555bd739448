"""Adam written in plain torch: the tests' oracle, and the kernel's documentation.

Runs in any floating dtype (float64 for an oracle whose own rounding error is
negligible next to float32's). Same formula and order as the kernel and as
``torch.optim.AdamW`` / ``Adam`` (single-tensor form).
"""

from __future__ import annotations

import torch
from torch import Tensor


def adam_reference(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns the updated (param, exp_avg, exp_avg_sq) in ``dtype``; inputs are not modified."""
    p, g, m, v = (t.detach().to(dtype) for t in (param, grad, exp_avg, exp_avg_sq))
    g = g * grad_scale
    if adamw_mode:
        p = p * (1 - lr * weight_decay)
    elif weight_decay != 0:
        g = g + weight_decay * p
    m = m + (g - m) * (1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    denom = v.sqrt() / bias_correction2**0.5 + eps
    p = p - (lr / bias_correction1) * (m / denom)
    return p, m, v
