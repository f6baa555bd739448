"""Clipping by the global grad norm inside the step (``CPUAdam(max_grad_norm=...)``): what is clipped to
(``check_max_grad_norm``), over which ranks plain grads add up (``norm_group_of``: asked where it cannot be
told, refused under DeepSpeed, which clips itself), and the factor, clip_grad_norm_'s (``clip_factor``). The
norm itself is ``cpu_adam.fsdp2.norm.total_norm``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .fsdp2.norm import total_norm
from .fsdp2.places import is_dtensor

__all__ = ["ASK", "check_max_grad_norm", "clip_factor", "clipped", "norm_group_of"]

ASK = "ask"  # norm_group's default: where the ranks' plain grads might be replicas or parts, ask which


def check_max_grad_norm(owner: str, max_grad_norm: object) -> float | None:
    """None (no clipping) or a finite number > 0."""
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
        raise TypeError(f"{owner}: max_grad_norm must be a number or None, got {max_grad_norm!r}")
    if not 0 < max_grad_norm < math.inf:
        raise ValueError(
            f"{owner}: max_grad_norm must be a finite number > 0 (or None: no clipping), got {max_grad_norm}"
        )
    return float(max_grad_norm)


def clipped(
    owner: str, grads: Sequence[Tensor], max_grad_norm: float, norm_group: object
) -> tuple[Tensor, float | None]:
    """The grads' global norm and the factor that clips them to ``max_grad_norm`` (None: the norm is not finite)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{owner}: max_grad_norm reads the grads' norm in Python, which a compiled step cannot; "
            "compile without it and clip with torch.nn.utils.clip_grad_norm_, or step eagerly"
        )
    norm = total_norm(grads, norm_group_of(grads, norm_group))
    return norm, clip_factor(norm, max_grad_norm) if bool(torch.isfinite(norm)) else None


def norm_group_of(grads: Sequence[Tensor], norm_group: object) -> object:
    """The process group over which plain grads are parts of the whole (None: each rank holds all of them), or a
    refusal where that cannot be told and was not said, or where the caller is DeepSpeed, which clips itself."""
    if _called_by_deepspeed():
        raise ValueError(
            "CPUAdam(max_grad_norm=...) under DeepSpeed: DeepSpeed hands CPUAdam each rank's partition of the grads "
            "(and under ZeRO-3 one sub-group per step() call), so no norm CPUAdam takes is the global one. Clip with "
            'DeepSpeed\'s own option, "gradient_clipping": <max norm> in its config, and leave max_grad_norm None'
        )
    if norm_group != ASK:
        return norm_group
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks > 1 and any(not is_dtensor(g) for g in grads):
        raise ValueError(
            f"CPUAdam(max_grad_norm=...) over plain tensors with {ranks} ranks in torch.distributed: CPUAdam cannot "
            "tell whether every rank holds all the grads (DDP's replicas) or a part of them (a partitioned "
            "optimizer), so it cannot tell the global norm. Say which: norm_group=None if each rank's grads are all "
            "of them, or norm_group=<the process group whose ranks hold the parts> to sum their squares over it"
        )
    return None


def _called_by_deepspeed() -> bool:
    """Whether the first caller outside torch's and our own wrappers (the step's hooks, no_grad) and outside any
    optimizer's methods (a subclass's step() that calls ours, an optimizer wrapping this one) is DeepSpeed's."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        wrapper = module.startswith(("torch.", "cpu_adam.", "contextlib", "functools"))
        if not wrapper and not isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
            return module.startswith("deepspeed.")
        frame = frame.f_back
    return False


def clip_factor(norm: Tensor, max_grad_norm: float) -> float:
    """What ``clip_grad_norm_`` multiplies the grads by: max_norm / (norm + 1e-6), at most 1."""
    return float(torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0))
