"""What ``param.grad`` holds once the offload optimizer has taken a grad to host memory.

Leaving ``None`` there made ``torch.nn.utils.clip_grad_norm_`` (which HF Trainer, accelerate and
Lightning call on the model's params) find no grads, clip nothing and report a norm of 0, in
silence. The placeholder keeps the param's shape, dtype and device (one element of memory,
expanded), and any computation with it raises an error that names the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["OffloadedGrad", "placeholder"]

# Metadata queries stay answerable: frameworks look at a grad's shape or device before using it.
_METADATA = {
    "shape",
    "dtype",
    "device",
    "layout",
    "is_sparse",
    "is_cuda",
    "requires_grad",
    "is_leaf",
    "grad_fn",
    "ndim",
    "size",
    "dim",
    "numel",
    "element_size",
    "__repr__",
    "__format__",
}

_FIX = (
    "cpu_adam.OffloadOptimizer took this grad to host memory during backward, so it cannot be used on the "
    "device. Clip with OffloadOptimizer(max_grad_norm=...) (and turn the framework's own clipping off: "
    "TrainingArguments(max_grad_norm=0), Trainer(gradient_clip_val=None)); read the norm from "
    "optimizer.last_grad_norm; drop grads with optimizer.zero_grad(). bf16 needs no GradScaler: call "
    "loss.backward() and optimizer.step() without one"
)


class OffloadedGrad(Tensor):
    """A grad the offload optimizer holds on the host: any use raises, naming the fix."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name in _METADATA or getattr(owner, "__name__", "") in _METADATA:
            return super().__torch_function__(func, types, args, kwargs or {})
        raise RuntimeError(f"{_FIX} (the call was {name or func})")


_scalars: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def placeholder(param: Tensor) -> OffloadedGrad:
    key = (param.dtype, param.device)
    if key not in _scalars:
        _scalars[key] = torch.zeros((), dtype=param.dtype, device=param.device)
    return _scalars[key].expand(param.shape).as_subclass(OffloadedGrad)
