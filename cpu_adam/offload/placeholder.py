"""What ``param.grad`` holds once the offload optimizer has taken a grad to host memory.

Frameworks clip by calling ``torch.nn.utils.clip_grad_norm_`` on the model's params (HF Trainer,
accelerate, Lightning), which takes each grad's 2-norm and multiplies each grad by the clipping
coefficient. The placeholder answers both from the host: its norm is the norm of the window's
summed grad, and a multiplication is recorded and folded into the step's grad scale. So the
framework's clipping clips for real and reports the real norm. The placeholder keeps the
param's shape, dtype and device (one element of memory, expanded); any other computation with
it raises an error that names the fix. ``torch.compile`` uses it eagerly (a graph break).
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable
from typing import Any, Protocol

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
    "stride",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "requires_grad_",
    "_has_compatible_shallow_copy_type",
    "__repr__",
    "__format__",
    "data",
}

# Read by torch.compile when it makes a fake copy of a tensor, or of a param it traces (its grad too):
# the placeholder answers as what it is, an expanded view of one element.
_DESCRIBED = {
    "_is_view",
    "_base",
    "is_nested",
    "is_mkldnn",
    "is_quantized",
    "is_inference",
    "untyped_storage",
    "storage_offset",
    "is_conj",
    "is_neg",
    "grad",
}

_MOVES = {"to", "cpu", "cuda", "bfloat16", "float", "half", "double", "type"}

_FIX = (
    "cpu_adam.OffloadOptimizer took this grad to host memory during backward, so it cannot be used on the "
    "device: only its 2-norm and a multiplication by a number (what torch.nn.utils.clip_grad_norm_ does) are "
    "supported. Clip with clip_grad_norm_ or OffloadOptimizer(max_grad_norm=...); read the norm from "
    "optimizer.last_grad_norm; drop grads with optimizer.zero_grad(). bf16 needs no GradScaler: call "
    "loss.backward() and optimizer.step() without one"
)


class GradSource(Protocol):
    """The side of the optimizer that holds the grads on the host."""

    epoch: int  # counts the steps and zero_grads: a placeholder of an earlier window is stale

    def grad_norm(self, g: int, i: int) -> float: ...

    def scale_grad(self, g: int, i: int, factor: Tensor | float) -> None: ...


class OffloadedGrad(Tensor):
    """A grad the offload optimizer holds on the host: its norm and scaling work, any other use raises."""

    _source: tuple[weakref.ref[GradSource], int, int, int]  # (source, group, param, window)

    @classmethod
    @torch.compiler.disable  # its answers come from the host when it runs: torch.compile runs it eagerly
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if owner == "data" and name == "__get__":  # grad.data is the grad itself: the host holds the numbers
            return args[0]
        if name in _METADATA or owner in _METADATA or name in _DESCRIBED or owner in _DESCRIBED:
            return super().__torch_function__(func, types, args, kwargs)
        if name in _MOVES:  # model.to(...) / model.cpu() move the grads too: still held on the host
            return args[0]._moved(func, *args[1:], **kwargs)
        if name == "zero_":  # model.zero_grad(set_to_none=False)
            return args[0]._zeroed()
        handler = _HANDLERS.get(name)
        if handler is not None:
            return handler(*args, **kwargs)
        raise RuntimeError(f"{_FIX} (the call was {name or func})")

    def _moved(self, func: Callable[..., Tensor], *args: Any, **kwargs: Any) -> OffloadedGrad:
        with torch._C.DisableTorchFunctionSubclass():
            element = torch.Tensor.as_strided(self, (), ())
            moved = func(element, *args, **kwargs).expand(self.shape).as_subclass(OffloadedGrad)
        moved._source = self._source
        return moved

    def _norm(self, dtype: torch.dtype | None) -> Tensor:
        source, g, i = self._resolve()
        return torch.tensor(source.grad_norm(g, i), dtype=dtype or torch.float32, device=self.device)

    def _scale(self, factor: Any) -> None:
        if not (isinstance(factor, numbers.Real) or (isinstance(factor, Tensor) and factor.numel() == 1)):
            raise RuntimeError(f"{_FIX} (a multiplication by a {type(factor).__name__} of shape other than one number)")
        source, g, i = self._resolve()
        source.scale_grad(g, i, factor)

    def _zeroed(self) -> OffloadedGrad:
        ref, _, _, window = self._source
        source = ref()
        if source is not None and source.epoch == window:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: this grad is part of the grads waiting for the next step() on the host; "
                "drop them with optimizer.zero_grad() (or model.zero_grad(), which sets grads to None)"
            )
        return self  # a grad the optimizer already stepped or dropped: nothing to zero

    def _resolve(self) -> tuple[GradSource, int, int]:
        ref, g, i, window = self._source
        source = ref()
        if source is None:
            raise RuntimeError("cpu_adam.OffloadOptimizer: this grad belongs to an optimizer that no longer exists")
        if source.epoch != window:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: this grad was already used by step() or dropped by zero_grad(); its norm "
                "and scaling belong to the backward passes before that. Take norms and clip after backward, before "
                "step(), and clear grads after the step (optimizer.zero_grad() or model.zero_grad())"
            )
        return source, g, i


def _check_two_norm(p: Any, dim: Any) -> None:
    if p not in (2, 2.0, "fro", None) or dim not in (None, (), []):
        raise RuntimeError(f"{_FIX} (a norm other than the 2-norm of the whole grad: ord={p!r}, dim={dim!r})")


def _vector_norm(x: Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype=None, out=None) -> Tensor:
    if out is not None or keepdim:
        raise RuntimeError(f"{_FIX} (vector_norm with out= or keepdim=True)")
    _check_two_norm(ord, dim)
    return x._norm(dtype)


def _norm(x: Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False, out=None, dtype=None) -> Tensor:
    return _vector_norm(x, p, dim, keepdim, dtype=dtype, out=out)


def _any_norm(t: Tensor, ord: Any, dtype: torch.dtype | None) -> Tensor:
    if isinstance(t, OffloadedGrad):
        return _vector_norm(t, ord, dtype=dtype)
    return torch.linalg.vector_norm(t, ord, dtype=dtype)


def _foreach_norm(tensors: list[Tensor], ord: Any = 2, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    return tuple(_any_norm(t, ord, dtype) for t in tensors)


def _mul_(x: Tensor, factor: Any) -> Tensor:
    x._scale(factor)
    return x


def _div_(x: Tensor, divisor: Any, *, rounding_mode: str | None = None) -> Tensor:
    if rounding_mode is not None:
        raise RuntimeError(f"{_FIX} (div_ with rounding_mode={rounding_mode!r})")
    x._scale(1.0 / divisor)
    return x


def _foreach_mul_(tensors: list[Tensor], factors: Any) -> None:
    each = factors if isinstance(factors, (list, tuple)) else [factors] * len(tensors)
    for t, factor in zip(tensors, each, strict=True):
        if isinstance(t, OffloadedGrad):
            t._scale(factor)
        else:
            t.mul_(factor)


_HANDLERS: dict[str, Callable[..., Any]] = {
    "linalg_vector_norm": _vector_norm,
    "norm": _norm,
    "_foreach_norm": _foreach_norm,
    "mul_": _mul_,
    "div_": _div_,
    "_foreach_mul_": _foreach_mul_,
}

_scalars: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def placeholder(param: Tensor, source: GradSource, g: int, i: int) -> OffloadedGrad:
    """The grad of param ``i`` of group ``g``, held on the host by ``source``."""
    key = (param.dtype, param.device)
    if key not in _scalars:
        _scalars[key] = torch.zeros((), dtype=param.dtype, device=param.device)
    grad = _scalars[key].expand(param.shape).as_subclass(OffloadedGrad)
    grad._source = (weakref.ref(source), g, i, source.epoch)
    return grad
