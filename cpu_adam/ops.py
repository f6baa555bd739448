"""Typed wrappers of ``torch.ops.cpu_adam.*``.

The library is loaded (or compiled, on first use) by the first call here, never
at import.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
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
    "adam_step_groups",
    "bandwidth_probe",
    "compiled_isas",
    "force_isa",
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

    for name in ("cpu_adam::adam_step_", "cpu_adam::check_adam_step", "cpu_adam::bandwidth_probe_"):
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
    them all first.

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
    op = _ops().check_adam_step if check_only else _ops().adam_step_
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
        )
    except Exception:
        # The op checks everything; these checks only put a friendlier message on what it refused
        # (per-tensor Python checks on every step cost more than the checks in C++).
        _check_all(params, grads, exp_avgs, exp_avg_sqs, outs)
        raise


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


class GroupStep(NamedTuple):
    """One param group's part of an optimizer step: the tensors of its params that have grads, their
    step counts (0-dim tensors, torch's ``state["step"]``), and the group's hyper-parameters as
    ``adam_step`` takes them (``counter_offsets``: one per tensor, or none without stochastic rounding).
    """

    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    steps: list[Tensor]
    lr: float | Tensor
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    grad_scale: float
    stochastic_rounding: bool
    seed: int
    counter_offsets: list[int]
    state_scales: Sequence[Tensor] = ()  # 8-bit moments: one [2, blocks] tensor per param


def adam_step_groups(owner: str, groups: Sequence[GroupStep]) -> None:
    """One optimizer step: each tensor's step count advances by one once its kernel has run.

    Tensors whose counts differ get a kernel call per count (their bias corrections differ).
    Eagerly, the caller has checked the hyper-parameters. Under ``torch.compile`` the whole step
    is one opaque op: the compiled step reads no tensor and branches on no value while traced.
    The op checks every group's hyper-parameters when it runs, before it steps any (values that
    change between calls are symbols while traced, and cannot be judged or printed then).
    """
    if torch.compiler.is_compiling():

        def joined(name: str) -> list[Any]:
            return [item for group in groups for item in getattr(group, name)]

        def each(name: str) -> list[Any]:
            return [getattr(group, name) for group in groups]

        _adam_step_groups_op(
            owner,
            [len(group.params) for group in groups],
            *(joined(name) for name in GroupStep._fields[:5]),
            # float64 holds a float lr exactly
            [lr if isinstance(lr, Tensor) else torch.tensor(lr, dtype=torch.float64) for lr in each("lr")],
            *(each(name) for name in GroupStep._fields[6:-2]),
            [offset for group in groups for offset in group.counter_offsets or [0] * len(group.params)],
            [bool(group.state_scales) for group in groups],
            joined("state_scales"),
        )
        return
    _step_groups(groups)


def _step_groups(groups: Sequence[GroupStep]) -> None:
    calls = [(group, indices, kwargs) for group in groups for indices, kwargs in _kernel_calls(group)]
    if len(calls) > 1:  # each call is all or nothing; checked together first, so is the whole step
        for _, _, kwargs in calls:
            adam_step(**kwargs, check_only=True)
    for group, indices, kwargs in calls:
        adam_step(**kwargs)
        for i in indices:  # counted once the kernel has run: a step that raised changes no count
            group.steps[i] += 1


def _kernel_calls(group: GroupStep) -> list[tuple[list[int], dict[str, Any]]]:
    """The group's ``adam_step`` arguments, one call per step count, with the tensors' indices."""
    by_count: dict[int, list[int]] = defaultdict(list)
    for i, count in enumerate(group.steps):
        by_count[int(count.item()) + 1].append(i)  # the step being taken
    calls = []
    for step, indices in by_count.items():
        params, grads, exp_avgs, exp_avg_sqs = ([tensors[i] for i in indices] for tensors in group[:4])
        kwargs = dict(
            params=params,
            grads=grads,
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            step=step,
            lr=float(group.lr),
            beta1=group.beta1,
            beta2=group.beta2,
            eps=group.eps,
            weight_decay=group.weight_decay,
            adamw_mode=group.adamw_mode,
            bias_correction=group.bias_correction,
            grad_scale=group.grad_scale,
            stochastic_rounding=group.stochastic_rounding,
            seed=group.seed,
            counter_offsets=[group.counter_offsets[i] for i in indices] if group.counter_offsets else None,
            state_scales=[group.state_scales[i] for i in indices] if group.state_scales else None,
        )
        calls.append((indices, kwargs))
    return calls


@torch.library.custom_op(
    "cpu_adam_py::adam_step_groups_", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps", "state_scales")
)
def _adam_step_groups_op(
    owner: str,
    sizes: list[int],
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    lr: list[Tensor],
    beta1: list[float],
    beta2: list[float],
    eps: list[float],
    weight_decay: list[float],
    adamw_mode: list[bool],
    bias_correction: list[bool],
    grad_scale: list[float],
    stochastic_rounding: list[bool],
    seed: list[int],
    counter_offsets: list[int],
    eight_bit: list[bool],
    state_scales: list[Tensor],
) -> None:
    """``adam_step_groups`` as compiled: the groups' lists joined, ``sizes`` saying where each ends
    (``state_scales`` holds those of the ``eight_bit`` groups only)."""
    joined = (params, grads, exp_avgs, exp_avg_sqs, steps)
    per_group = (
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        adamw_mode,
        bias_correction,
        grad_scale,
        stochastic_rounding,
        seed,
    )
    groups, start, scales_start = [], 0, 0
    for g, size in enumerate(sizes):
        end = start + size
        offsets = counter_offsets[start:end] if stochastic_rounding[g] or eight_bit[g] else []
        scales = state_scales[scales_start : scales_start + size] if eight_bit[g] else []
        scales_start += len(scales)
        groups.append(
            GroupStep(*(each[start:end] for each in joined), *(each[g] for each in per_group), offsets, scales)
        )
        start = end
    for g, group in enumerate(groups):
        betas = (group.beta1, group.beta2)
        check_hyper_parameters(
            f"{owner} param group {g} (compiled step)", group.lr, betas, group.eps, group.weight_decay
        )
    _step_groups(groups)


@_adam_step_groups_op.register_fake
def _(*args) -> None:
    return None  # it only mutates its inputs


# ---- hyper-parameter checks, shared by both optimizers ----


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
