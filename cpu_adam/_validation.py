"""The checks shared by CPUAdam and the offload optimizer: hyper-parameters, the stochastic
rounding seed, and loaded step counts."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from torch import Tensor

__all__ = ["check_hyper_parameters", "check_param_group", "check_step_count", "check_torch_flags", "checked_seed"]


def check_hyper_parameters(owner: str, lr: float | Tensor, betas: Any, eps: float, weight_decay: float) -> None:
    """Refuses what the step cannot use, where it is set: construction, add_param_group,
    load_state_dict and every step (a param group edited in place).

    What ``torch.optim.AdamW`` refuses raises its exception with its message, followed by
    ``owner`` and what is allowed; beyond AdamW, infinite values, and values that are not numbers
    (TypeError). A 1-element tensor lr is accepted, as in torch.
    """
    if not _finite_and_non_negative(_lr_value(owner, lr)):
        raise ValueError(f"Invalid learning rate: {lr} ({owner}: lr must be a finite number >= 0)")
    if not _finite_and_non_negative(_number(owner, "eps", eps)):
        raise ValueError(f"Invalid epsilon value: {eps} ({owner}: eps must be a finite number >= 0)")
    for index, beta in enumerate(_pair_of_numbers(owner, betas)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta} ({owner}: betas must be in [0, 1))")
    if not _finite_and_non_negative(_number(owner, "weight_decay", weight_decay)):
        raise ValueError(
            f"Invalid weight_decay value: {weight_decay} ({owner}: weight_decay must be a finite number >= 0)"
        )


def check_torch_flags(foreach: Any, fused: Any, amsgrad: Any, capturable: Any, differentiable: Any) -> None:
    """torch's checks and messages for what it refuses whatever the device, then what CPUAdam does not implement."""
    if fused and differentiable:
        raise RuntimeError("`fused` does not support `differentiable` (nor does CPUAdam: use torch.optim.AdamW)")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together. (CPUAdam: pass at most one of them)")
    if amsgrad:
        raise ValueError(
            "CPUAdam does not implement amsgrad; use torch.optim.AdamW(amsgrad=True) for it, or drop amsgrad=True"
        )
    if capturable or differentiable:
        raise ValueError(
            "CPUAdam supports neither capturable=True (CUDA graph capture of the step) nor differentiable=True "
            "(autograd through the step); use torch.optim.AdamW for those"
        )


def check_param_group(owner: str, group: Mapping[str, Any]) -> None:
    """``check_hyper_parameters`` on a param group's values."""
    check_hyper_parameters(owner, group["lr"], group["betas"], group["eps"], group["weight_decay"])


def checked_seed(owner: str, seed: Any) -> int:
    """The stochastic rounding seed as the kernel takes it: an integer of 64 bits."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{owner}: seed must be an integer, got {seed!r}")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"{owner}: seed must fit in 64 bits (signed), got {seed}")
    return int(seed)


def check_step_count(owner: str, count: Any) -> None:
    """A loaded step count (a number or a 1-element tensor) must be a whole number >= 0."""
    value = count.item() if isinstance(count, Tensor) and count.numel() == 1 else count
    if not (_is_number(value) and math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(
            f"{owner}: a step count must be a whole number >= 0, got {value!r}; "
            "the state dict was damaged or edited, and a step would use wrong bias corrections"
        )


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _number(owner: str, name: str, value: Any) -> float:
    if not _is_number(value):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    return float(value)


def _finite_and_non_negative(value: float) -> bool:
    return 0.0 <= value < math.inf  # also False for nan


def _lr_value(owner: str, lr: Any) -> float:
    if not isinstance(lr, Tensor):
        return _number(owner, "lr", lr)
    if lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element ({owner}: got shape {tuple(lr.shape)})")
    return _number(owner, "lr", lr.item())


def _pair_of_numbers(owner: str, betas: Any) -> tuple[float, float]:
    def refused(error: type[Exception], hint: str = "") -> Exception:
        return error(f"{owner}: betas must be a pair of numbers (beta1, beta2), got {betas!r}{hint}")

    sequence = isinstance(betas, (tuple, list))
    if sequence and any(isinstance(b, Tensor) for b in betas):
        raise refused(TypeError, "; tensor betas are not supported: pass floats")
    if not sequence or not all(_is_number(b) for b in betas):
        raise refused(TypeError)
    if len(betas) != 2:
        raise refused(ValueError)
    return float(betas[0]), float(betas[1])
