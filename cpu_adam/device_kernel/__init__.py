"""The host kernel's Adam step on the device: the same bits, where the state lives in device memory.

``adam_step`` takes what ``cpu_adam.ops.adam_step`` takes (less the preview modes) on CUDA tensors,
or on CPU tensors through Triton's interpreter (slow: for tests), and writes the bits the host
kernel would write: the scalars are folded by the host's own code (``ops.fold_hyper``), each
operation is rounded once in the host's order with denormals flushed as the host's architecture
flushes them (``floats.py``), bf16 stores and 8-bit codes draw the host's random bits from the
same counters and keys. So a step can be split between host and device anyhow and give the bits of
one host step.

Written in Triton, which pip's CUDA builds of torch ship: no CUDA toolkit is needed, and the
interpreter runs the same source on a machine without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import platform
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import torch
from torch import Tensor

from .. import ops
from ..quant8 import BLOCK as Q8_BLOCK

__all__ = ["Launches", "adam_step", "add_launch", "available", "missing_reason", "prepare_step"]

# Elements per launch at most: a multiple of the 8-bit block whose counters cross a 2^32 boundary at most once.
_PIECE = 2**30
_TILE = {"cuda": (1024, 4), "cpu": (8192, 32)}  # elements per program (float moments), 256-blocks (8-bit)
_NO_FLUSH_BELOW = 2.0**-126


def missing_reason() -> str | None:
    """Why the device kernel cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return (
            "the device step needs Triton, which pip's CUDA builds of torch install; here it is missing: "
            "pip install triton (or use device_fraction=0.0)"
        )
    return None


def available() -> bool:
    return missing_reason() is None


def tininess_before_rounding() -> bool:
    """Whether the host kernel flushes a result that is tiny before rounding (AArch64) or after (x86-64)."""
    return platform.machine().lower() in ("aarch64", "arm64")


class Launches:
    """The kernel launches of a step, checked and compiled: calling it writes the tensors."""

    def __init__(self) -> None:
        self._launches: list[tuple[Any, tuple, tuple, dict[str, Any]]] = []

    def add(self, kernel: Any, grid: tuple, args: tuple, kwargs: dict[str, Any]) -> None:
        variant = (kernel, *sorted(kwargs.items()))
        if variant not in _compiled:  # a compile error is raised here, before anything is written
            kernel.warmup(*args, grid=grid, **kwargs)
            _compiled.add(variant)
        self._launches.append((kernel, grid, args, kwargs))

    def __call__(self) -> None:
        for kernel, grid, args, kwargs in self._launches:
            kernel[grid](*args, **kwargs)


_compiled: set[tuple] = set()


def prepare_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
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
    bf16_outs: Sequence[Tensor] | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    counter_offsets: Sequence[int] | None = None,
    state_scales: Sequence[Tensor] | None = None,
    before_rounding: bool | None = None,
) -> Launches:
    """``cpu_adam.ops.adam_step`` on device tensors up to its first write: every check made and every kernel compiled;
    calling the result steps, bit for bit as the host kernel. Every tensor contiguous (8-bit scales: each row).

    ``before_rounding``: flush results that are tiny before rounding (an AArch64 host's rule) or
    after (x86-64's); by default this host's.
    """
    reason = missing_reason()
    if reason is not None:
        raise RuntimeError(f"cpu_adam: {reason}")
    params, grads, exp_avgs, exp_avg_sqs = list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)
    outs = list(bf16_outs) if bf16_outs is not None else []
    scales = list(state_scales) if state_scales is not None else []
    _check(params, grads, exp_avgs, exp_avg_sqs, outs, scales)
    launches = Launches()
    if not params:
        return launches
    scalars = (float(lr), float(beta1), float(beta2), float(eps), float(weight_decay))
    h = _folded(int(step), *scalars, bool(adamw_mode), bool(bias_correction), float(grad_scale))
    random_bits = stochastic_rounding or bool(scales)
    if not random_bits:
        counter_offsets = [0] * len(params)
    elif counter_offsets is None:
        counter_offsets = ops.back_to_back(params)
    if len(counter_offsets) != len(params) or any(int(o) < 0 or int(o) % 2 for o in counter_offsets):
        raise ValueError(f"cpu_adam: counter_offsets must be one even number >= 0 per param, got {counter_offsets}")
    before = tininess_before_rounding() if before_rounding is None else bool(before_rounding)
    for i, param in enumerate(params):
        n = param.numel()
        out, scale = outs[i] if outs else None, scales[i] if scales else None
        tensors = (param, grads[i], exp_avgs[i], exp_avg_sqs[i], out, scale)
        for begin in range(0, n, _PIECE):
            end = min(n, begin + _PIECE)
            counter = int(counter_offsets[i]) + begin
            high, low = counter >> 32, counter & 0xFFFFFFFF
            keys = (_key(seed, step, high), _key(seed, step, high + 1)) if random_bits else (0, 0)
            wrap = min(end - begin, (1 << 32) - low)
            add_launch(launches, h, tensors, begin, end, low, keys, wrap, stochastic_rounding, before)
    return launches


def add_launch(
    launches: Launches,
    h: ops.FoldedHyper,
    tensors: Sequence[Tensor | None],
    begin: int,
    end: int,
    first_counter: int,
    keys: tuple[int, int],
    wrap: int,
    stochastic_rounding: bool,
    before_rounding: bool,
) -> None:
    """The launch of elements [begin, end) of one param's tensors (param, grad, exp_avg, exp_avg_sq, bf16 output or
    None, 8-bit state scales or None), checked by ``prepare_step``, with the host kernel's own scalars: ``h`` folded,
    the 32-bit counter of element ``begin``, the keys before and after the counter wraps, and where it wraps
    (elements from ``begin``). ``prepare_step`` builds each launch here; tests feed it a host's recorded scalars."""
    from . import kernels
    from .launch import for_device

    param, grad, exp_avg, exp_avg_sq, out, scales = tensors
    assert param is not None and grad is not None and exp_avg is not None and exp_avg_sq is not None
    block, rows = _TILE["cuda" if param.device.type == "cuda" else "cpu"]
    floats = _kernel_scalars(h)
    flags = dict(HAS_L2=h.l2 != 0.0, LERP_FROM_GRAD=h.lerp_from_grad, BEFORE_ROUNDING=before_rounding)
    eight_bit = scales is not None
    kernel = for_device(kernels.adam_q8_kernel if eight_bit else kernels.adam_kernel, param.device)
    kinds = dict(
        PARAM=_code(param.dtype),
        GRAD=_code(grad.dtype),
        HAS_OUT=out is not None,
        STOCHASTIC=stochastic_rounding and param.dtype == torch.bfloat16,
    )
    if not eight_bit:
        kinds["STATE"] = _code(exp_avg.dtype)
    pieces = [_bits(t, begin, end) for t in (param, grad, exp_avg, exp_avg_sq)]
    pieces.append(_bits(out, begin, end) if out is not None else pieces[0])
    if scales is not None:
        pieces.append(scales[0, begin // Q8_BLOCK :])  # its row 1 lies a row stride further
        grid = (-(-(end - begin) // (Q8_BLOCK * rows)),)
        sizes, tile = (end - begin, scales.stride(0)), dict(ROWS=rows)
    else:
        grid = (-(-(end - begin) // block),)
        sizes, tile = (end - begin,), dict(BLOCK=block)
    counters = (_signed(first_counter), _signed(keys[0]), _signed(keys[1]), wrap)
    options = dict(**kinds, **flags, **tile, enable_fp_fusion=False)
    launches.add(kernel, grid, (*pieces, *sizes, *counters, *floats), options)


_P = ParamSpec("_P")


def _run_at_once(prepare: Callable[_P, Launches]) -> Callable[_P, None]:
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        prepare(*args, **kwargs)()

    run.__name__ = run.__qualname__ = "adam_step"
    run.__doc__ = "``prepare_step`` with its launches run at once: ``cpu_adam.ops.adam_step`` on device tensors."
    run.__signature__ = inspect.signature(prepare).replace(return_annotation="None")  # type: ignore[attr-defined]
    return run


adam_step = _run_at_once(prepare_step)


# A step launches a kernel per bucket, all with the same scalars and a few keys: each is computed once.
@functools.lru_cache(maxsize=64)
def _folded(*scalars: Any) -> ops.FoldedHyper:
    names = ("step", "lr", "beta1", "beta2", "eps", "weight_decay", "adamw_mode", "bias_correction", "grad_scale")
    return ops.fold_hyper(**dict(zip(names, scalars)))


@functools.lru_cache(maxsize=64)
def _kernel_scalars(h: ops.FoldedHyper) -> tuple[float, ...]:
    """The folded scalars in the kernels' argument order, as the host reads them."""
    scalars = (h.step_size, h.inv_bc2_sqrt, h.eps, h.decay, h.l2, h.grad_scale)
    scalars += (h.one_minus_beta1, h.one_minus_weight, h.beta2, h.one_minus_beta2)
    return tuple(_flushed(x) for x in scalars)


@functools.lru_cache(maxsize=256)
def _key(seed: int, step: int, high: int) -> int:
    return ops.random_key(seed, step, high)


def _code(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.bfloat16 else 0


def _bits(t: Tensor, begin: int, end: int) -> Tensor:
    """Elements [begin, end) of a flat view; bf16 as its int16 bits."""
    flat = t.view(-1)[begin:end]
    return flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat


def _signed(u: int) -> int:
    """A uint32 as the int32 with its bits (Triton passes int32 arguments)."""
    return u - (1 << 32) if u >= 1 << 31 else u


def _flushed(x: float) -> float:
    """A float32 scalar as the host reads it: a denormal is a zero of its sign."""
    return math.copysign(0.0, x) if 0 < abs(x) < _NO_FLUSH_BELOW else x


_FLOAT = (torch.float32, torch.bfloat16)


def _check(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    outs: list[Tensor],
    scales: list[Tensor],
) -> None:
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if outs:
        lists["bf16_outs"] = outs
    if scales:
        lists["state_scales"] = scales
    for name, tensors in lists.items():
        if len(tensors) != len(params):
            raise ValueError(f"cpu_adam: {len(params)} params but {len(tensors)} {name}")
    every = [t for ts in (params, *lists.values()) for t in ts]
    devices = {t.device for t in every}
    if len(devices) > 1:
        raise RuntimeError(f"cpu_adam: the device step's tensors are on several devices ({devices}); put them on one")
    for i, p in enumerate(params):
        tuple_ = {"param": p, **{name[:-1]: ts[i] for name, ts in lists.items()}}
        for name, t in tuple_.items():
            if not (t.is_contiguous() or (name == "state_scale" and t.dim() == 2 and t.stride(1) == 1)):
                raise ValueError(f"cpu_adam: the device step takes contiguous tensors; {name} {i} is not")
        if p.dtype not in _FLOAT or grads[i].dtype not in _FLOAT:
            raise TypeError(
                f"cpu_adam: param and grad {i} must be float32 or bfloat16, got {p.dtype}, {grads[i].dtype}"
            )
        state = exp_avgs[i].dtype
        if (
            exp_avg_sqs[i].dtype != state
            or state not in (*_FLOAT, torch.uint8)
            or (state == torch.uint8) != bool(scales)
        ):
            raise TypeError(
                f"cpu_adam: the moments of param {i} must both be float32, bfloat16, or uint8 codes with their "
                f"state_scales; got {state} and {exp_avg_sqs[i].dtype}"
            )
        for name, t in tuple_.items():
            if name != "state_scale" and t.numel() != p.numel():
                raise ValueError(f"cpu_adam: {name} {i} has {t.numel()} elements, its param {p.numel()}")
        if outs and outs[i].dtype != torch.bfloat16:
            raise TypeError(f"cpu_adam: bf16_outs[{i}] must be bfloat16, got {outs[i].dtype}")
        if scales and (scales[i].dtype != torch.float32 or tuple(scales[i].shape) != (2, -(-p.numel() // Q8_BLOCK))):
            raise ValueError(
                f"cpu_adam: state_scales[{i}] must be float32 of shape (2, {-(-p.numel() // Q8_BLOCK)}), "
                f"got {scales[i].dtype} {tuple(scales[i].shape)}"
            )
