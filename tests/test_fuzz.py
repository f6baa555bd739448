"""Seeded fuzzing of the op, CPUAdam and OffloadOptimizer (on the CPU device) with good and bad arguments.

Every case is drawn from (seed, index) alone. The cases run in a child process with a time limit per
case, so that a crash or a hang fails the test instead of taking pytest down. A case fails when
- it raises anything but a ValueError, TypeError or RuntimeError, or with a message that does not
  name what is wrong (the argument, the tensor's place in its list);
- it raises and a tensor, storage byte or step count changed (a half-applied step);
- an op call with a planted fault is accepted, or one without is refused;
- an accepted op step differs, in any byte of any storage, from the same step on separate
  contiguous copies of each tuple, or leaves non-finite values where a float64 Adam stays finite;
- an optimizer's accepted step leaves non-finite state from finite inputs.

Long runs print the outcome classes: ``python tests/test_fuzz.py --cases 20000 [--seed 1]``;
``--first K --cases 1 --trace`` replays case K.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import random
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, also when run as a script

from cpu_adam import CPUAdam, OffloadOptimizer, ops

CI_CASES = 1500
CASE_TIMEOUT_S = 60.0  # a case takes milliseconds; the first one also loads the kernels
SHAPES = [(), (0,), (1,), (2,), (7,), (33,), (4, 5), (3, 0, 2), (2, 3, 4), (4097,), (70001,)]
SHAPE_WEIGHTS = [2, 2, 3, 2, 4, 4, 4, 1, 3, 1, 1]
DTYPES = [torch.float32, torch.bfloat16]
ROLES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "bf16_outs")
WRITTEN = (0, 2, 3, 4)
BAD_SCALARS = {
    "lr": [math.nan, math.inf, -math.inf, -1e-3, 1e39, 1e300],
    "beta1": [math.nan, 1.0, 1.5, -0.1, math.inf, 1e300],
    "beta2": [math.nan, 1.0, -1e-9, 2.0, 1e300],
    "eps": [math.nan, math.inf, -1e-8, 1e39],
    "weight_decay": [math.nan, math.inf, -0.1, 1e300],
    "grad_scale": [math.nan, math.inf, -math.inf, 1e39, 1e300],
    "step": [0, -1, -(2**40)],
    "bias_correction1": [0.0, -0.5, math.nan, math.inf, 1e-300],
    "bias_correction2": [0.0, -0.5, math.nan, math.inf, 1e-300],
}
BAD_TYPES = ["0.1", None, [0.1], 1 + 2j, object()]


class Failure(Exception):
    """The case broke a rule; the message says which."""


@dataclass
class Fault:
    what: str
    names: tuple[str, ...]  # an error about it says what is wrong when it has one of these
    # Refused at every step, whether its group's params have grads or not: a value outside the
    # range a hyper-parameter may take (a finite value that only overflows the step is refused
    # when the step uses it).
    always: bool = False


# ---- tensors and their bytes ----


def is_cpu_tensor(t: Any) -> bool:
    return isinstance(t, Tensor) and t.device.type == "cpu" and t.layout == torch.strided


def storage_bytes(t: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def snapshot(tensors: list[Any]) -> dict[int, Tensor]:
    """Every byte of every CPU storage under the tensors."""
    return {t.untyped_storage().data_ptr(): storage_bytes(t).clone() for t in tensors if is_cpu_tensor(t)}


def changed_storages(tensors: list[Any], before: dict[int, Tensor]) -> list[int]:
    now = {t.untyped_storage().data_ptr(): storage_bytes(t) for t in tensors if is_cpu_tensor(t)}
    return [ptr for ptr, b in before.items() if not torch.equal(now[ptr], b)]


def in_storage(t: Tensor, storage: Tensor) -> Tensor:
    """The view ``t`` is of its storage, over another copy of those bytes."""
    return storage.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def check_error(error: BaseException, faults: list[Fault]) -> str:
    """The outcome class of an exception, or a Failure when it does not say what is wrong."""
    message = str(error)
    if not isinstance(error, (ValueError, TypeError, RuntimeError)):
        raise Failure(f"raised {type(error).__name__}: {message[:300]}")
    names = [n for f in faults for n in f.names]
    if not any(n in message for n in names):
        raise Failure(f"{type(error).__name__} that names none of {names}: {message[:300]}")
    return type(error).__name__


# ---- the op ----


@dataclass
class OpCase:
    via: str  # "raw" (torch.ops.cpu_adam.adam_step_), "wrapper" (ops.adam_step), "check" (check_adam_step)
    lists: list[Any]
    scalars: dict[str, Any]
    faults: list[Fault] = field(default_factory=list)


def random_tensor(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, scale: float, rng: random.Random):
    t = (torch.randn(shape, generator=g) * scale).to(dtype)
    if rng.random() < 0.25:  # the same values in a non-contiguous view
        holder = torch.zeros((*shape, 2), dtype=dtype)[..., rng.randrange(2)]
        holder.copy_(t)
        t = holder
    return t


def valid_scalars(rng: random.Random, via: str) -> dict[str, Any]:
    s = {
        "lr": rng.choice([0.0, 1e-5, 1e-3, 0.1, 1.0]),
        "beta1": rng.choice([0.0, 0.5, 0.9, 0.999]),
        "beta2": rng.choice([0.0, 0.9, 0.999, 0.99999]),
        "eps": rng.choice([0.0, 1e-40, 1e-8, 1e-3]),
        "weight_decay": rng.choice([0.0, 0.0, 0.01, 0.5]),
        "adamw_mode": rng.random() < 0.7,
        "grad_scale": rng.choice([1.0, 1.0, 0.5, -1.0, 0.0, 7.0]),
        "stochastic_rounding": rng.random() < 0.3,
        "seed": rng.randrange(2**62),
        "step": rng.choice([1, 1, 2, 10, 1000]),
    }
    if via == "wrapper":
        s["bias_correction"] = rng.random() < 0.8
    else:
        corrected = rng.random() < 0.8
        s["bias_correction1"] = 1.0 - s["beta1"] ** s["step"] if corrected else 1.0
        s["bias_correction2"] = 1.0 - s["beta2"] ** s["step"] if corrected else 1.0
    return s


def make_op_case(rng: random.Random, g: torch.Generator) -> OpCase:
    via = rng.choice(["raw", "wrapper", "wrapper", "check"])
    n = rng.choice([0, 1, 1, 2, 2, 3])
    with_outs = rng.random() < 0.3
    lists: list[list[Any]] = [[] for _ in ROLES]
    for _ in range(n):
        shape = rng.choices(SHAPES, SHAPE_WEIGHTS)[0]
        p_dtype, g_dtype, s_dtype = (rng.choice(DTYPES) for _ in range(3))
        scale = rng.choice([1e-3, 1.0, 100.0])
        lists[0].append(random_tensor(g, shape, p_dtype, 1.0, rng))
        lists[1].append(random_tensor(g, shape, g_dtype, scale, rng))
        lists[2].append(random_tensor(g, shape, s_dtype, 0.1 * scale, rng))
        lists[3].append(random_tensor(g, shape, s_dtype, scale, rng).abs_())
        if with_outs:
            lists[4].append(random_tensor(g, shape, torch.bfloat16, 1.0, rng))
    case = OpCase(via, lists, valid_scalars(rng, via))
    if case.scalars["stochastic_rounding"] or (via != "wrapper" and rng.random() < 0.5):
        case.scalars["counter_offsets"] = ops.back_to_back(lists[0], start=2 * rng.randrange(2**20))
    elif via != "wrapper":
        case.scalars["counter_offsets"] = []
    if rng.random() < 0.3:
        share_memory_validly(case, rng)
    faults = rng.choices([0, 1, 2], [45, 45, 10])[0]
    for _ in range(faults):
        rng.choice(PLANTERS)(case, rng)
    return case


def tensor_slots(case: OpCase, roles=range(5)) -> list[tuple[int, int]]:
    """The places of the dense CPU tensors (where faults are planted)."""
    return [(r, i) for r in roles for i, t in enumerate(case.lists[r]) if is_cpu_tensor(t)]


def share_memory_validly(case: OpCase, rng: random.Random) -> None:
    """Memory shared where the op must accept it: interleaved views, a bf16 grad as its output, read-only grads."""
    kind = rng.choice(["interleave", "interleave", "grad as output", "expanded grad", "one grad for two tuples"])
    slots = [(r, i) for r, i in tensor_slots(case, WRITTEN) if case.lists[r][i].numel() > 1]
    if kind == "interleave" and len(slots) >= 2:
        interleave(case, rng.sample(slots, 2))
    elif kind == "grad as output" and case.lists[4]:
        i = rng.randrange(len(case.lists[4]))
        case.lists[1][i] = case.lists[4][i] = case.lists[1][i].to(torch.bfloat16)
    elif kind == "expanded grad" and case.lists[1]:
        i = rng.randrange(len(case.lists[1]))
        grad = case.lists[1][i]
        if grad.numel() > 0:
            case.lists[1][i] = grad.reshape(-1)[:1].clone().expand(grad.numel()).view(grad.shape)
    elif kind == "one grad for two tuples" and len(case.lists[1]) >= 2:
        i, j = rng.sample(range(len(case.lists[1])), 2)
        if case.lists[1][i].numel() == case.lists[1][j].numel():
            case.lists[1][j] = case.lists[1][i].view(case.lists[1][j].shape)


def interleave(case: OpCase, slots: list[tuple[int, int]]) -> None:
    """The two tensors' elements alternate in one buffer (each element at its own aligned offset)."""
    tensors = [case.lists[r][i] for r, i in slots]
    widest = max(t.element_size() for t in tensors)
    buffer = torch.zeros(2 * widest * max(t.numel() for t in tensors), dtype=torch.uint8)
    for lane, ((r, i), t) in enumerate(zip(slots, tensors)):
        per_pitch = 2 * widest // t.element_size()
        view = buffer.view(t.dtype)[lane * widest // t.element_size() :: per_pitch][: t.numel()].view(t.shape)
        view.copy_(t)
        case.lists[r][i] = view


# ---- planted faults: each makes the call invalid, and says what an error about it may name ----


def plant_bad_scalar(case: OpCase, rng: random.Random) -> None:
    names = [n for n in BAD_SCALARS if n in case.scalars or n == "step"]
    if case.via == "wrapper":
        names = [n for n in names if not n.startswith("bias_correction")]
    name = rng.choice(names)
    case.scalars[name] = rng.choice(BAD_SCALARS[name])
    if name in ("weight_decay", "bias_correction1") and case.scalars["lr"] == 0.0:
        case.scalars["lr"] = 1e-3  # an lr of 0 would fold a huge weight_decay or a tiny bias correction away
    case.faults.append(Fault(f"{name}={case.scalars[name]}", (name,)))


def plant_bad_type(case: OpCase, rng: random.Random) -> None:
    name = rng.choice(["lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale", "step", "seed"])
    case.scalars[name] = rng.choice(BAD_TYPES)
    case.faults.append(Fault(f"{name} of type {type(case.scalars[name]).__name__}", (name,)))


def plant_non_tensor(case: OpCase, rng: random.Random) -> None:
    r = rng.randrange(4)
    case.lists[r].insert(rng.randrange(len(case.lists[r]) + 1), rng.choice([1.0, None, "x", [torch.zeros(2)]]))
    case.faults.append(Fault(f"a non-tensor in {ROLES[r]}", (ROLES[r],)))


def plant_bad_dtype(case: OpCase, rng: random.Random) -> None:
    slots = tensor_slots(case)
    if not slots:
        return plant_length_mismatch(case, rng)
    r, i = rng.choice(slots)
    bad = [torch.float16, torch.float64, torch.int32] + ([torch.float32] if r == 4 else [])
    case.lists[r][i] = case.lists[r][i].to(rng.choice(bad))
    names = (ROLES[r], "exp_avg_sqs") if r == 2 else (ROLES[r], "exp_avgs") if r == 3 else (ROLES[r],)
    case.faults.append(Fault(f"{ROLES[r]}[{i}] is {case.lists[r][i].dtype}", names))


def plant_moment_dtypes_apart(case: OpCase, rng: random.Random) -> None:
    pairs = [i for r, i in tensor_slots(case, [2]) if (3, i) in tensor_slots(case, [3])]
    if not pairs:
        return plant_bad_dtype(case, rng)
    i = rng.choice(pairs)
    other = torch.bfloat16 if case.lists[2][i].dtype == torch.float32 else torch.float32
    case.lists[3][i] = case.lists[3][i].to(other)
    case.faults.append(Fault(f"exp_avg_sqs[{i}] is {other}, its exp_avg not", ("exp_avg_sqs", "exp_avgs")))


def plant_numel_mismatch(case: OpCase, rng: random.Random) -> None:
    slots = tensor_slots(case)
    if not slots:
        return plant_length_mismatch(case, rng)
    r, i = rng.choice(slots)
    t = case.lists[r][i]
    case.lists[r][i] = torch.zeros(t.numel() + rng.choice([1, 3]), dtype=t.dtype)
    case.faults.append(Fault(f"{ROLES[r]}[{i}] has {t.numel()} + a few elements", (ROLES[r], "params")))


def plant_length_mismatch(case: OpCase, rng: random.Random) -> None:
    r = rng.randrange(5)
    extra = torch.zeros(3, dtype=torch.bfloat16)
    if r == 4:  # one output more than params (one fewer could leave none, which is valid)
        case.lists[4] = case.lists[4] or [torch.zeros(t.shape, dtype=torch.bfloat16) for t in case.lists[0]]
        case.lists[4].append(extra)
    elif case.lists[r] and rng.random() < 0.5:
        case.lists[r].pop()
    else:
        case.lists[r].append(extra)
    case.faults.append(Fault(f"{ROLES[r]} of another length", ROLES))


def plant_meta_tensor(case: OpCase, rng: random.Random) -> None:
    slots = tensor_slots(case)
    if len(slots) < 2:  # a call on meta tensors alone is a no-op (tracing, model init)
        return plant_bad_scalar(case, rng)
    r, i = rng.choice(slots)
    case.lists[r][i] = case.lists[r][i].to("meta")
    case.faults.append(Fault(f"{ROLES[r]}[{i}] on meta", ROLES))


def plant_sparse_tensor(case: OpCase, rng: random.Random) -> None:
    slots = [(r, i) for r, i in tensor_slots(case) if case.lists[r][i].dim() > 0]
    if not slots:
        return plant_bad_scalar(case, rng)
    r, i = rng.choice(slots)
    case.lists[r][i] = case.lists[r][i].to_sparse()
    case.faults.append(Fault(f"{ROLES[r]}[{i}] is sparse", (ROLES[r],)))


def plant_shared_written_memory(case: OpCase, rng: random.Random) -> None:
    """Two slots of which one is written share bytes (never an output that is exactly its grad)."""
    slots = [(r, i) for r, i in tensor_slots(case) if case.lists[r][i].numel() > 0]
    written = [s for s in slots if s[0] in WRITTEN]
    if not written or len(slots) < 2:
        return plant_self_overlap(case, rng)
    first = rng.choice(written)
    second = rng.choice([s for s in slots if s != first])
    a, b = case.lists[first[0]][first[1]], case.lists[second[0]][second[1]]
    if rng.random() < 0.3 and a.numel() == b.numel() and a.dtype == b.dtype and {first[0], second[0]} != {1, 4}:
        case.lists[second[0]][second[1]] = a  # the same tensor twice
    else:  # b starts inside a, possibly inside one of its elements
        buffer = torch.zeros(a.numel() * a.element_size() + b.numel() * b.element_size() + 8, dtype=torch.uint8)
        a_view = buffer[: a.numel() * a.element_size()].view(a.dtype).view(a.shape)
        start = rng.randrange(max(1, a.numel())) * a.element_size() + rng.choice([0, a.element_size() // 2])
        start -= start % b.element_size()
        b_view = buffer[start : start + b.numel() * b.element_size()].view(b.dtype).view(b.shape)
        a_view.copy_(a)
        b_view.copy_(b)
        case.lists[first[0]][first[1]], case.lists[second[0]][second[1]] = a_view, b_view
        if first[0] in (1, 4) and second[0] in (1, 4) and first[1] == second[1] and start == 0 and a.dtype == b.dtype:
            return  # exactly the grad as its output: allowed
    case.faults.append(Fault(f"{ROLES[first[0]]}[{first[1]}] shares memory", ("share memory",)))


def plant_self_overlap(case: OpCase, rng: random.Random) -> None:
    slots = [(r, i) for r, i in tensor_slots(case, WRITTEN) if case.lists[r][i].numel() > 1]
    if not slots:
        return plant_bad_scalar(case, rng)
    r, i = rng.choice(slots)
    t = case.lists[r][i]
    case.lists[r][i] = t.reshape(-1)[:1].clone().expand(t.numel()).view(t.shape)
    case.faults.append(Fault(f"{ROLES[r]}[{i}] is expanded", (ROLES[r],)))


def plant_bad_counter_offsets(case: OpCase, rng: random.Random) -> None:
    if case.via == "wrapper" and not case.scalars["stochastic_rounding"]:
        case.scalars["stochastic_rounding"] = True  # the wrapper passes offsets only then
    n = len(case.lists[0])
    bad = rng.choice([[1] * max(n, 1), [-2] * max(n, 1), [0] * (n + 1), [2**63 + 1] * max(n, 1)])
    case.scalars["counter_offsets"] = bad
    case.faults.append(Fault("counter_offsets", ("counter_offsets", "counter offsets")))


PLANTERS: list[Callable[[OpCase, random.Random], None]] = [
    plant_bad_scalar,
    plant_bad_scalar,
    plant_bad_scalar,
    plant_bad_type,
    plant_non_tensor,
    plant_bad_dtype,
    plant_moment_dtypes_apart,
    plant_numel_mismatch,
    plant_length_mismatch,
    plant_meta_tensor,
    plant_sparse_tensor,
    plant_shared_written_memory,
    plant_shared_written_memory,
    plant_self_overlap,
    plant_bad_counter_offsets,
]


def call_op(case: OpCase, lists: list[Any]) -> None:
    s = case.scalars
    if case.via == "wrapper":
        ops.adam_step(*lists[:4], bf16_outs=lists[4], **s)
        return
    ops._ops()
    op = torch.ops.cpu_adam.check_adam_step if case.via == "check" else torch.ops.cpu_adam.adam_step_
    names = ["lr", "beta1", "beta2", "eps", "weight_decay", "adamw_mode", "bias_correction1", "bias_correction2"]
    names += ["grad_scale", "stochastic_rounding", "seed", "step", "counter_offsets"]
    op(*lists, *(s[n] for n in names), [])  # state_scales: float moments


def adam_float64(p, g, m, v, s: dict[str, Any], bias_corrections: tuple[float, float]) -> Tensor:
    """Where Adam in float64 keeps every intermediate within float32's range: there the float32 step
    must end finite too. (Elsewhere float32 may overflow: with v = 0, m / eps alone can pass 3.4e38.)"""
    fits = torch.ones(p.shape, dtype=torch.bool)

    def within(x: Tensor) -> Tensor:
        fits.logical_and_(x.abs() <= torch.finfo(torch.float32).max)
        return x

    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = within(g * s["grad_scale"])
    if s["adamw_mode"]:
        p = within(p * (1 - s["lr"] * s["weight_decay"]))
    else:
        g = within(g + s["weight_decay"] * p)
    m = within(m + (g - m) * (1 - s["beta1"]))
    v = within(v * s["beta2"] + within((1 - s["beta2"]) * within(g * g)))
    eps = max(s["eps"], torch.finfo(torch.float32).tiny) if s["eps"] > 0 else 0.0  # the kernel's floor
    ratio = within(m / within(v.sqrt() / math.sqrt(bias_corrections[1]) + eps))
    within(p - within((s["lr"] / bias_corrections[0]) * ratio))
    return fits


def bias_corrections(s: dict[str, Any]) -> tuple[float, float]:
    if "bias_correction1" in s:
        return s["bias_correction1"], s["bias_correction2"]
    if not s["bias_correction"]:
        return 1.0, 1.0
    return 1.0 - s["beta1"] ** s["step"], 1.0 - s["beta2"] ** s["step"]


def expected_after_op(case: OpCase, before: dict[int, Tensor]) -> dict[int, Tensor]:
    """Every storage as it must be after the step: each tuple stepped alone on contiguous copies."""
    expected = {ptr: b.clone() for ptr, b in before.items()}
    if case.via == "check":
        return expected
    offsets = case.scalars.get("counter_offsets") or []
    if case.via == "wrapper" and case.scalars["stochastic_rounding"] and not offsets:
        offsets = ops.back_to_back(case.lists[0])
    for i in range(len(case.lists[0])):
        alone = [
            [case.lists[r][i].clone(memory_format=torch.contiguous_format)] if case.lists[r] else [] for r in range(5)
        ]
        call_op(OpCase(case.via, alone, {**case.scalars, "counter_offsets": [offsets[i]] if offsets else []}), alone)
        for r in WRITTEN:
            if case.lists[r]:
                t = case.lists[r][i]
                in_storage(t, expected[t.untyped_storage().data_ptr()]).copy_(alone[r][0])
    return expected


def check_finite_where_float64_is(case: OpCase, before_lists: list[list[Tensor]]) -> None:
    bc = bias_corrections(case.scalars)
    for i in range(len(case.lists[0])):
        inputs = [before_lists[r][i] for r in range(4)]
        if not all(t.isfinite().all() for t in inputs):
            continue
        fits = adam_float64(*inputs, case.scalars, bc)
        for r in WRITTEN if case.lists[4] else WRITTEN[:-1]:
            lost = ~case.lists[r][i].isfinite() & fits
            if lost.any():
                raise Failure(
                    f"{ROLES[r]}[{i}] has {int(lost.sum())} non-finite values where float64 Adam fits float32"
                )


def run_op_case(case: OpCase) -> str:
    tensors = [t for ts in case.lists for t in ts]
    before = snapshot(tensors)
    before_lists = [[t.clone() if is_cpu_tensor(t) else t for t in ts] for ts in case.lists]
    expected = None
    if not case.faults:
        expected = expected_after_op(case, before)
    try:
        call_op(case, case.lists)
    except Exception as error:
        if not case.faults:
            raise Failure(f"refused a valid call: {type(error).__name__}: {str(error)[:300]}") from None
        outcome = check_error(error, case.faults)
        if changed_storages(tensors, before):
            raise Failure(f"raised {outcome} after writing: a half-applied step") from None
        return outcome
    if case.faults:
        raise Failure(f"accepted a call with {', '.join(f.what for f in case.faults)}")
    if expected is not None:
        now = {t.untyped_storage().data_ptr(): storage_bytes(t) for t in tensors if is_cpu_tensor(t)}
        for ptr, bytes_expected in expected.items():
            if not torch.equal(now[ptr], bytes_expected):
                raise Failure("the step differs from stepping each tuple alone on contiguous copies")
    if case.via != "check":
        check_finite_where_float64_is(case, before_lists)
    return "accepted"


def describe_op_case(case: OpCase) -> str:
    def tensor(t: Any) -> str:
        if not isinstance(t, Tensor):
            return type(t).__name__
        layout = "" if t.is_contiguous() or t.layout != torch.strided else f" strides {t.stride()}"
        device = "" if t.device.type == "cpu" else f" on {t.device}"
        return f"{str(t.dtype)[6:]}{list(t.shape)}{layout}{device}"

    lists = "; ".join(f"{role} [{', '.join(map(tensor, ts))}]" for role, ts in zip(ROLES, case.lists))
    faults = ", ".join(f.what for f in case.faults) or "none"
    return f"op via {case.via}: {lists}; faults: {faults}"


# ---- the optimizers ----


def bits_equal(a: Any, b: Any) -> bool:
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return a == b
    if a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device.type == "meta" or a.layout != torch.strided:
        return True
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def make_params(rng: random.Random, g: torch.Generator, dtypes: list[torch.dtype], transposed: bool):
    params = []
    for _ in range(rng.randint(1, 4)):
        p = torch.randn(rng.choices(SHAPES[:-2], SHAPE_WEIGHTS[:-2])[0], generator=g).to(rng.choice(dtypes))
        if transposed and p.dim() == 2 and rng.random() < 0.3:
            p = p.t()  # a non-contiguous param, updated in place
        params.append(torch.nn.Parameter(p))
    return params


def valid_hyper(rng: random.Random) -> dict[str, Any]:
    return {
        "lr": rng.choice([1e-4, 1e-3, 0.1]),
        "betas": (rng.choice([0.0, 0.9]), rng.choice([0.9, 0.999])),
        "eps": rng.choice([1e-8, 1e-3]),
        "weight_decay": rng.choice([0.0, 0.01]),
    }


def plant_bad_hyper(rng: random.Random, group: dict[str, Any]) -> Fault:
    name = rng.choice(["lr", "beta1", "beta2", "eps", "weight_decay"])
    value = rng.choice(BAD_SCALARS[name])
    if name.startswith("beta"):
        betas = list(group["betas"])
        betas[int(name[-1]) - 1] = value
        group["betas"] = tuple(betas)
    else:
        group[name] = value
    if group["lr"] == 0.0:
        group["lr"] = 1e-3  # else a huge weight_decay folds away
    out_of_range = not math.isfinite(value) or value < 0 or (name.startswith("beta") and value >= 1)
    return Fault(f"{name}={value}", (name, "betas"), always=out_of_range)


def cpuadam_state(optimizer: CPUAdam, params: list[Tensor]) -> list[Any]:
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        out += [p.detach().clone()] + [state[k].clone() if k in state else None for k in ("step", *MOMENTS)]
    return out


MOMENTS = ("exp_avg", "exp_avg_sq")


def plant_cpuadam_fault(rng: random.Random, optimizer: CPUAdam, params: list[Tensor]) -> tuple[Fault, int | None]:
    """A fault planted between steps: a bad hyper-parameter (of the group returned) or a bad tensor."""
    kind = rng.choice(["hyper", "hyper", "dtype", "sparse grad", "meta state"])
    with_grads = [p for p in params if p.grad is not None]
    stepped = [p for p in with_grads if optimizer.state.get(p)]
    if kind == "dtype" and with_grads:
        p = rng.choice(with_grads)
        p.data = p.data.to(rng.choice([torch.float64, torch.float16]))
        p.grad = torch.zeros_like(p)
        return Fault(f"a param made {p.dtype}", ("dtype",)), None
    if kind == "sparse grad" and any(p.dim() > 0 for p in with_grads):
        p = rng.choice([p for p in with_grads if p.dim() > 0])
        p.grad = p.grad.to_sparse()
        return Fault("a sparse grad", ("grads",)), None
    if kind == "meta state" and stepped:  # as a state dict saved from a model built on the meta device
        state = optimizer.state[rng.choice(stepped)]
        state["exp_avg"] = state["exp_avg"].to("meta")
        return Fault("an exp_avg on meta", ("exp_avgs",)), None
    index = rng.randrange(len(optimizer.param_groups))
    return plant_bad_hyper(rng, optimizer.param_groups[index]), index


def run_cpuadam_case(rng: random.Random, g: torch.Generator) -> tuple[str, str]:
    params = make_params(rng, g, DTYPES, transposed=True)
    options = {
        "adamw_mode": rng.random() < 0.7,
        "fp32_optimizer_states": rng.random() < 0.6,
        "stochastic_rounding": rng.random() < 0.3,
        "maximize": rng.random() < 0.2,
        "bias_correction": rng.random() < 0.8,
        **valid_hyper(rng),
    }
    split = rng.randint(1, len(params))
    groups = [{"params": params[:split]}, {"params": params[split:], "lr": rng.choice([1e-4, 0.1])}][
        : 1 + (split < len(params))
    ]
    description = f"CPUAdam, {len(groups)} groups of {[(str(p.dtype)[6:], list(p.shape)) for p in params]}"
    faults: list[tuple[Fault, int | None]] = []
    if rng.random() < 0.1:  # a bad default, in one group (that overrides nothing)
        groups = [{"params": params}]
        faults.append((plant_bad_hyper(rng, options), None))
        description += f", built with {faults[0][0].what}"
    try:
        optimizer = CPUAdam(groups, **options)
    except Exception as error:
        if not faults:
            raise Failure(f"{description}: refused: {error}") from None
        return check_error(error, [f for f, _ in faults]), description
    outcome = "accepted"
    for step in range(rng.randint(1, 3)):
        for p in params:
            p.grad = None if rng.random() < 0.2 else (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)
        if rng.random() < 0.3:
            faults.append(plant_cpuadam_fault(rng, optimizer, params))
            description += f"; before step {step}: {faults[-1][0].what}"
        live = [f for f, group in faults if f.always or any(p.grad is not None for p in grouped(optimizer, group))]
        before = cpuadam_state(optimizer, params)
        grads = [p.grad.clone() if is_cpu_tensor(p.grad) else None for p in params]
        try:
            optimizer.step()
        except Exception as error:
            if not live:
                raise Failure(f"{description}: refused step {step}: {error}") from None
            outcome = check_error(error, live)
            for a, b in zip(cpuadam_state(optimizer, params), before):
                if b is not None and not bits_equal(a, b):  # (a state made for the step has count 0 and zeros)
                    raise Failure(f"{description}: raised {outcome} after writing: a half-applied step") from None
            return outcome, description
        if live:
            raise Failure(f"{description}: accepted step {step} with {live[0].what}")
        for p, grad in zip(params, grads):
            finite_in = grad is not None and grad.isfinite().all()
            if finite_in and not all(t.isfinite().all() for t in (p, *(optimizer.state[p][k] for k in MOMENTS))):
                raise Failure(f"{description}: non-finite state from finite inputs at step {step}")
    return outcome, description


def grouped(optimizer: torch.optim.Optimizer, index: int | None) -> list[Tensor]:
    groups = optimizer.param_groups if index is None else [optimizer.param_groups[index]]
    return [p for group in groups for p in group["params"]]


def offload_state(optimizer: OffloadOptimizer, params: list[Tensor]) -> list[Any]:
    out = [p.detach().clone() for p in params] + [optimizer.skipped_steps]
    out += [m.clone() for m in optimizer.master_weights()]
    store = optimizer._rooms.store  # the host buffers: a state dict before the first step holds none
    for g, layout in enumerate(optimizer._rooms.layouts):
        if layout is not None:
            tensors = store.export(g)
            out += [tensors["exp_avg"].clone(), tensors["exp_avg_sq"].clone(), list(store.steps[g])]
    return out


def plant_offload_construction_fault(rng: random.Random, groups: list[dict[str, Any]], options: dict) -> Fault:
    kind = rng.choice(["a float32 param", "a non-contiguous param", "params sharing memory", "a bad max_grad_norm"])
    if kind == "a float32 param":
        groups[0]["params"][0].data = groups[0]["params"][0].data.float()
    elif kind == "a non-contiguous param":
        groups[0]["params"][0] = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16).t())
    elif kind == "params sharing memory":
        buffer = torch.zeros(16, dtype=torch.bfloat16)
        groups[0]["params"][:1] = [torch.nn.Parameter(buffer[:10]), torch.nn.Parameter(buffer[6:])]
    else:
        options["max_grad_norm"] = rng.choice([0.0, -1.0, math.nan, math.inf, "1"])
    return Fault(kind, ("OffloadOptimizer",))


def run_offload_case(rng: random.Random, g: torch.Generator) -> tuple[str, str]:
    params = make_params(rng, g, [torch.bfloat16], transposed=False)
    split = rng.randint(1, len(params))
    groups = [{"params": params[:split]}, {"params": params[split:], **valid_hyper(rng)}][: 1 + (split < len(params))]
    master = rng.choice([torch.float32, torch.bfloat16])
    options = {
        "fp32_optimizer_states": rng.random() < 0.6,
        "master_weights_dtype": master,
        "stochastic_rounding": master == torch.bfloat16 and rng.random() < 0.5,
        "max_grad_norm": rng.choice([None, 1.0, 1e-3]),
        "bucket_size": rng.choice([16, 256, 4096]),
        "adamw_mode": rng.random() < 0.7,
        **valid_hyper(rng),
    }
    description = f"OffloadOptimizer, {len(groups)} groups of {[list(p.shape) for p in params]}"
    fault = plant_offload_construction_fault(rng, groups, options) if rng.random() < 0.1 else None
    description += f", built with {fault.what}" if fault else ""
    try:
        optimizer = OffloadOptimizer(groups, **options)
    except Exception as error:
        if fault is None:
            raise Failure(f"{description}: refused: {error}") from None
        return check_error(error, [fault]), description
    try:
        if fault is not None:
            raise Failure(f"{description}: accepted")
        return step_offload(rng, g, optimizer, description)
    finally:
        optimizer.close()


def step_offload(rng: random.Random, g: torch.Generator, optimizer: OffloadOptimizer, description: str):
    params = grouped(optimizer, None)
    weights = [torch.randn(p.shape, generator=g) for p in params]
    bad_groups: list[tuple[int, Fault]] = []
    for step in range(rng.randint(1, 3)):
        used = [p for p in params if rng.random() < 0.85]
        if used:
            loss = sum((p.float() * w).sum() for p, w in zip(params, weights) if any(p is q for q in used))
            if rng.random() < 0.1:
                loss = loss * math.inf  # a non-finite grad norm skips the step
            loss.backward()
        if rng.random() < 0.3:
            index = rng.randrange(len(optimizer.param_groups))
            bad_groups.append((index, plant_bad_hyper(rng, optimizer.param_groups[index])))
            description += f"; before step {step}: group {index} {bad_groups[-1][1].what}"
        # A group counts as stepped when a param of it got a grad, an empty one too (its count advances).
        live = [(i, f) for i, f in bad_groups if f.always or any(p is q for p in grouped(optimizer, i) for q in used)]
        before = offload_state(optimizer, params)
        skipped = optimizer.skipped_steps
        try:
            optimizer.step()
        except Exception as error:
            if not live:
                raise Failure(f"{description}: refused step {step}: {error}") from None
            outcome = check_error(error, [f for _, f in live])
            if not all(bits_equal(a, b) for a, b in zip(offload_state(optimizer, params), before)):
                raise Failure(f"{description}: raised {outcome} after writing: a half-applied step") from None
            return outcome, description
        if live and optimizer.skipped_steps == skipped:
            raise Failure(f"{description}: accepted step {step} with {live[0][1].what}")
        if not all(t.isfinite().all() for t in offload_state(optimizer, params) if isinstance(t, Tensor)):
            raise Failure(f"{description}: non-finite state from finite inputs at step {step}")
    return "accepted", description


# ---- running ----


def run_case(seed: int, index: int, trace: bool) -> tuple[str, str | None, str]:
    """(target, outcome or None when it failed, description or failure)."""
    rng = random.Random(f"{seed}:{index}")
    g = torch.Generator().manual_seed(rng.getrandbits(62))
    target = rng.choices(["op", "CPUAdam", "OffloadOptimizer"], [60, 25, 15])[0]
    description = target
    try:
        if target == "op":
            case = make_op_case(rng, g)
            description = describe_op_case(case)
            if trace:
                print(f"case {index}: {description}", file=sys.stderr, flush=True)
            return target, run_op_case(case), description
        if trace:
            print(f"case {index}: {target}", file=sys.stderr, flush=True)
        run = run_cpuadam_case if target == "CPUAdam" else run_offload_case
        outcome, description = run(rng, g)
        return target, outcome, description
    except Failure as failure:
        return target, None, f"{description}: {failure}" if target == "op" else str(failure)
    except Exception:  # a bug of the fuzz itself: reported with the case, the run goes on
        return target, None, f"{description}: the fuzz raised\n{traceback.format_exc()}"


def run_cases(seed: int, first: int, count: int, trace: bool) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    logging.getLogger("cpu_adam").setLevel(logging.ERROR)
    outcomes: Counter[str] = Counter()
    failures = []
    for index in range(first, first + count):
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        target, outcome, description = run_case(seed, index, trace)
        if outcome is None:
            failures.append({"case": index, "target": target, "failure": description})
            outcome = "FAILED"
        outcomes[f"{target}: {outcome}"] += 1
    faulthandler.cancel_dump_traceback_later()
    return {"seed": seed, "first": first, "cases": count, "outcomes": dict(outcomes), "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=CI_CASES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=0, help="index of the first case (to replay one)")
    parser.add_argument("--trace", action="store_true", help="name each case on stderr before it runs")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = parser.parse_args()
    start = time.perf_counter()
    summary = run_cases(args.seed, args.first, args.cases, args.trace)
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"seed {args.seed}, cases {args.first}..{args.first + args.cases - 1}: {time.perf_counter() - start:.0f} s"
        )
        for outcome, count in sorted(summary["outcomes"].items()):
            print(f"  {count:7d}  {outcome}")
        for failure in summary["failures"]:
            print(f"FAILED case {failure['case']}: {failure['failure']}")
        print(f"{len(summary['failures'])} failures")
    return 1 if summary["failures"] else 0


@pytest.mark.slow
def test_fuzz_finds_no_crash_hang_half_step_or_unclear_error() -> None:
    command = [sys.executable, __file__, "--cases", str(CI_CASES), "--seed", "0", "--trace", "--json"]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=CI_CASES * 0.2 + 60)
    except subprocess.TimeoutExpired as hang:
        last = (hang.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
        pytest.fail(f"the fuzz run hung; last case started: {last}")
    if child.returncode not in (0, 1) or not child.stdout.strip():
        lines = child.stderr.splitlines()
        last_case = [line for line in lines if line.startswith("case ")][-1:]
        report = "\n".join(line for line in lines if not line.startswith("case "))[-3000:]
        pytest.fail(
            f"the fuzz run stopped (exit {child.returncode}: a crash, or a case past {CASE_TIMEOUT_S:.0f} s) "
            f"in {last_case}:\n{report}"
        )
    summary = json.loads(child.stdout.strip().splitlines()[-1])
    failures = "\n".join(f"case {f['case']}: {f['failure']}" for f in summary["failures"][:10])
    assert not summary["failures"], f"{len(summary['failures'])} failing cases, the first:\n{failures}"
    # Not vacuous: every target both accepted calls and refused bad ones.
    outcomes = summary["outcomes"]
    for target in ("op", "CPUAdam", "OffloadOptimizer"):
        accepted = outcomes.get(f"{target}: accepted", 0)
        refused = sum(n for k, n in outcomes.items() if k.startswith(f"{target}: ") and "Error" in k)
        assert accepted > 10 and refused > 10, outcomes


if __name__ == "__main__":
    sys.exit(main())
