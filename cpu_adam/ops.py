"""Typed wrappers of ``torch.ops.cpu_adam.*``.

The library is loaded (or compiled, on first use) by the first call here, never
at import.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _build, quant8
from ._threads import judge_threads_once

__all__ = [
    "PROBE_VARIANTS",
    "active_isa",
    "adam_step",
    "bandwidth_probe",
    "compiled_isas",
    "fold_hyper",
    "force_isa",
    "random_key",
    "squared_norms",
    "supported_isas",
    "threads_for",
]


_fakes_registered = False
ROLES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "bf16_outs")


def _ops():
    global _fakes_registered
    _build.load()
    if not _fakes_registered:
        _register_fakes()
        _fakes_registered = True
    return torch.ops.cpu_adam


def _register_fakes() -> None:
    # The ops only mutate their inputs, so tracing (torch.compile) needs no shapes from them.
    # The fakes also run for a meta tensor among CPU tensors, which must not pass as a step.
    def on_one_device(params, grads, exp_avgs, exp_avg_sqs, bf16_outs, *scalars) -> None:
        _check_one_device(params, grads, exp_avgs, exp_avg_sqs, bf16_outs)

    for name in (
        "cpu_adam::adam_step_",
        "cpu_adam::adam_preview_",
        "cpu_adam::adam_step_then_preview_",
        "cpu_adam::check_adam_step",
        "cpu_adam::bandwidth_probe_",
    ):
        torch.library.register_fake(name)(on_one_device)


def _check_one_device(*lists: Sequence[Tensor]) -> None:
    named = [(f"{role}[{i}]", t) for role, ts in zip(ROLES, lists) for i, t in enumerate(ts)]
    for name, t in named[1:]:
        if t.device != named[0][1].device:
            raise RuntimeError(
                f"cpu_adam: {named[0][0]} is on {named[0][1].device} but {name} is on {t.device}; every tensor "
                "of a step must be on one device (the CPU)"
            )


def _check_dense_cpu(tensors: Sequence[Tensor], role: str) -> None:
    # Devices and layouts are checked before dispatch: a CUDA, meta or sparse
    # tensor would otherwise fail inside torch's dispatcher with a message that
    # does not say what to do.
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"cpu_adam: {role}[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise RuntimeError(
                f"cpu_adam: {role}[{i}] is a {t.layout} tensor; Adam here needs dense tensors "
                "(for embeddings use sparse=False, or convert the grad with .to_dense())"
            )
        if t.device.type != "cpu":
            raise RuntimeError(
                f"cpu_adam: {role}[{i}] is on {t.device}; the kernel updates CPU tensors. Move the "
                "optimizer state and params to the CPU, or use cpu_adam.OffloadOptimizer for "
                "parameters that live on an accelerator"
            )


def _check_all(params, grads, exp_avgs, exp_avg_sqs, bf16_outs) -> None:
    for tensors, role in zip((params, grads, exp_avgs, exp_avg_sqs, bf16_outs), ROLES):
        _check_dense_cpu(tensors, role)


class NextStep(NamedTuple):
    """The step previewed right after a step, element by element (``adam_step(..., then=NextStep(...))``)."""

    grads: Sequence[Tensor]
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float = 0.0
    adamw_mode: bool = True
    grad_scale: float = 1.0
    bias_correction: bool = True


def adam_step(
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
    check_only: bool = False,
    preview: bool = False,
    then: NextStep | None = None,
) -> None:
    """One fused Adam/AdamW step over every tensor in the lists, in place.

    ``step`` is the step count including this one (1 on the first step). Grads
    are multiplied by ``grad_scale`` first (clipping, averaging). Where given,
    ``bf16_outs[i]`` receives the updated ``params[i]`` rounded to bfloat16; it
    may be the very tensor ``grads[i]`` when that grad is bfloat16.
    ``stochastic_rounding`` applies to bfloat16 params only; the random bits of
    element ``e`` of ``params[i]`` (for its param store and, with 8-bit moments,
    for their codes) are a function of ``(seed, step, counter_offsets[i] + e)``.
    Offsets (even numbers) place the tensors in one counter space, so a tensor
    stepped in other calls or lists, or split otherwise, gets the same bits; by
    default the list is that space, its tensors back to back.

    Every argument is checked before anything is written: the step updates every
    tensor or raises and leaves them all as they were. ``check_only`` runs those
    checks and writes nothing, for callers that step in several calls and check
    them all first. ``preview`` writes the ``bf16_outs`` alone (one per param), bit
    for bit as the step would, and leaves params and moments as they are: a step
    computed before it is known whether it will be taken. ``then`` runs the step and,
    right after each element's, the preview of the next step from what it stored:
    ``bf16_outs`` (required, and here the only output) receive the next step's
    weights, and may be this step's own bf16 grads; one pass over the state for both.

    8-bit moments (``cpu_adam.quant8``): ``exp_avgs`` and ``exp_avg_sqs`` are uint8 codes and
    ``state_scales[i]`` the float32 [2, ceil(numel / 256)] block scales of both, updated in place;
    the new codes are rounded stochastically (with or without ``stochastic_rounding``).
    """
    # Lists once: generators would be used up by the checks.
    params, grads, exp_avgs, exp_avg_sqs = list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)
    outs = list(bf16_outs) if bf16_outs is not None else []
    scales = list(state_scales) if state_scales is not None else []
    if params and not check_only and not torch.compiler.is_compiling():  # a system call would break a graph
        judge_threads_once()
    if not (stochastic_rounding or scales):  # 8-bit codes round stochastically too
        counter_offsets = []  # no random bits drawn
    elif counter_offsets is None:
        counter_offsets = back_to_back(params)
    op = _ops().check_adam_step if check_only else _ops().adam_preview_ if preview else _ops().adam_step_
    follow: list[Any] = []
    if then is not None:
        op = _ops().adam_step_then_preview_
        b1, b2 = (_bias_correction(b, then.step) if then.bias_correction else 1.0 for b in (then.beta1, then.beta2))
        scalars = [then.lr, then.beta1, then.beta2, then.eps, then.weight_decay, b1, b2, then.grad_scale]
        follow = [list(then.grads), [float(x) for x in scalars], then.adamw_mode, then.step]
    try:
        op(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            outs,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            adamw_mode,
            _bias_correction(beta1, step) if bias_correction else 1.0,
            _bias_correction(beta2, step) if bias_correction else 1.0,
            grad_scale,
            stochastic_rounding,
            seed,
            step,
            list(counter_offsets),
            scales,
            *follow,
        )
    except Exception:
        # The op checks everything; these checks only put a friendlier message on what it refused
        # (per-tensor Python checks on every step cost more than the checks in C++).
        _check_all(params, grads, exp_avgs, exp_avg_sqs, outs)
        raise


class FoldedHyper(NamedTuple):
    """The step's scalars as the kernel computes with them (float32 values), folded as ``adam_step`` folds them."""

    step_size: float
    inv_bc2_sqrt: float
    eps: float
    decay: float
    l2: float
    grad_scale: float
    one_minus_beta1: float
    lerp_from_grad: bool
    one_minus_weight: float
    beta2: float
    one_minus_beta2: float


def fold_hyper(
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
) -> FoldedHyper:
    """The scalars ``adam_step`` would compute with, for a kernel elsewhere that must use the very same floats;
    raises what ``adam_step`` raises for them."""
    b1, b2 = (_bias_correction(b, step) if bias_correction else 1.0 for b in (beta1, beta2))
    folded = list(_ops().fold_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, b1, b2, grad_scale, step))
    folded[7] = folded[7] != 0.0
    return FoldedHyper(*folded)


def random_key(seed: int, step: int, high: int) -> int:
    """The key (uint32) of the random bits of the counters whose high 32 bits are ``high``, at ``seed`` and ``step``."""
    return int(_ops().random_key(seed, step, high)) & 0xFFFFFFFF


def _bias_correction(beta: float, step: int) -> float:
    """1 - beta**step, or nan where that cannot be taken: the op then names the argument that is wrong."""
    try:
        return 1.0 - math.pow(beta, step)
    except (ArithmeticError, TypeError, ValueError):
        return math.nan


def back_to_back(tensors: Sequence[Tensor], start: int = 0) -> list[int]:
    """Counter offsets that put ``tensors`` one after another from ``start``, each at a multiple of
    256 elements from it: the offload optimizer's layout, so that CPUAdam draws the same bits."""
    offsets = []
    for t in tensors:
        offsets.append(start)
        start += -(-t.numel() // quant8.BLOCK) * quant8.BLOCK
    return offsets


def group_counter_base(index: int) -> int:
    """Where param group ``index`` starts in the counter space: groups never share random bits."""
    return index << 48


PROBE_VARIANTS = ("plain", "prefetched", "streaming", "prefetched+streaming")


def bandwidth_probe(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    bf16_outs: Sequence[Tensor] | None = None,
    state_scales: Sequence[Tensor] | None = None,
    variant: str = "prefetched",
) -> None:
    """Moves exactly the bytes ``adam_step`` moves, as raw vectors with no arithmetic: its roofline.

    ``variant`` (one of ``PROBE_VARIANTS``) is how memory is asked for: with the kernel's
    software prefetch or without, with plain or non-temporal (streaming) stores. The fastest
    depends on the machine: take the best of all. Overwrites the tensors: every byte of params,
    moments and block scales plus one (mod 256), the bf16 outputs filled with 0x3F; grads are read.
    """
    if variant not in PROBE_VARIANTS:
        raise ValueError(f"cpu_adam: the probe variant is one of {', '.join(PROBE_VARIANTS)}; got {variant!r}")
    outs = list(bf16_outs) if bf16_outs is not None else []
    scales = list(state_scales) if state_scales is not None else []
    _check_all(params, grads, exp_avgs, exp_avg_sqs, outs)
    _ops().bandwidth_probe_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), outs, scales, variant)


def compiled_isas() -> list[str]:
    """ISAs compiled into the loaded library, best first."""
    return list(_ops().compiled_isas())


def supported_isas() -> list[str]:
    """Compiled ISAs this CPU can run, best first."""
    return list(_ops().supported_isas())


def active_isa() -> str:
    """The ISA the next step runs on (the best supported, or CPU_ADAM_ISA)."""
    return str(_ops().active_isa())


def threads_for(numel: int) -> int:
    """How many threads a step over ``numel`` elements runs on (at most torch.get_num_threads())."""
    return int(_ops().threads_for(numel))


@contextmanager
def force_isa(name: str) -> Iterator[None]:
    """Runs the block on one ISA (tests, benchmarks); not for concurrent steps."""
    previous = _ops().set_isa(name)
    try:
        yield
    finally:
        _ops().set_isa(previous)


def squared_norms(tensors: Sequence[Tensor]) -> Tensor:
    """Each tensor's sum of squares, float64 [len(tensors)], for float32 and bfloat16 tensors on the CPU.

    Every square is exact and they are summed in one fixed order (``csrc/kernels/squares.h``), so a sum does not
    depend on the thread count or the ISA; all tensors in one parallel region, at memory speed.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return _ops().squared_norms(list(tensors))
