"""CPUAdam's step over all its param groups: one ``adam_step`` per group and step count eagerly,
one opaque custom op under ``torch.compile``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._signals import interrupts_deferred
from ._validation import check_hyper_parameters
from .ops import adam_step

__all__ = ["GroupStep", "adam_step_groups", "check_groups"]


class GroupStep(NamedTuple):
    """One param group's part of an optimizer step: the tensors of its params that have grads, their
    step counts (0-dim tensors, torch's ``state["step"]``), and the group's hyper-parameters as
    ``adam_step`` takes them (``counter_offsets``: one per tensor, or none without stochastic rounding).
    A param may be stepped as several tensors (``fsdp2.places.pieces``): all but one then count in a copy of
    its step count, and ``write_backs`` are (stepped copy, destination) pairs copied once stepped.
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
    write_backs: Sequence[tuple[Tensor, Tensor]] = ()


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
            *(each(name) for name in GroupStep._fields[6:-3]),
            [offset for group in groups for offset in group.counter_offsets or [0] * len(group.params)],
            [bool(group.state_scales) for group in groups],
            joined("state_scales"),
            [copy for group in groups for copy, _ in group.write_backs],
            [destination for group in groups for _, destination in group.write_backs],
        )
        return
    _step_groups(groups)


def check_groups(groups: Sequence[GroupStep]) -> None:
    """Every kernel call of these groups' step checked, none run: a step refused here changes nothing."""
    _check_calls([kwargs for group in groups for _, kwargs in _kernel_calls(group)])


def _check_calls(calls: Sequence[dict[str, Any]]) -> None:
    for kwargs in calls:
        adam_step(**kwargs, check_only=True)


def _step_groups(groups: Sequence[GroupStep]) -> None:
    calls = [(group, indices, kwargs) for group in groups for indices, kwargs in _kernel_calls(group)]
    if len(calls) > 1:  # each call is all or nothing; checked together first, so is the whole step
        _check_calls([kwargs for _, _, kwargs in calls])
    with interrupts_deferred():  # Ctrl-C: after the counts, which change with the tensors
        for group, indices, kwargs in calls:
            adam_step(**kwargs)
            for i in indices:  # counted once the kernel has run: a step that raised changes no count
                group.steps[i] += 1
        for group in groups:
            for copy, destination in group.write_backs:
                destination.copy_(copy)


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
    "cpu_adam_py::adam_step_groups_",
    mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps", "state_scales", "copies", "destinations"),
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
    copies: list[Tensor],
    destinations: list[Tensor],
) -> None:
    """``adam_step_groups`` as compiled: the groups' lists joined, ``sizes`` saying where each ends
    (``state_scales`` holds those of the ``eight_bit`` groups only; the write-backs are all the last group's)."""
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
        written = list(zip(copies, destinations)) if g == len(sizes) - 1 else []
        groups.append(
            GroupStep(*(each[start:end] for each in joined), *(each[g] for each in per_group), offsets, scales, written)
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
