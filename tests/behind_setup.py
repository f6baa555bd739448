"""Models, training and comparisons for the tests of the step behind the forward (``cpu_adam.fsdp2``).

A pair of identical FSDP2 models trains on the same batches, one with the serial step and one with the step behind
the forward; after every step their shards, grads and optimizer states are compared bit for bit. The model has a
root with params of its own (an input layer and a head, gathered first), blocks as units of their own, and rows
that shard unevenly (33 rows over 2 and 4 ranks, an empty shard at 4).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from cpu_adam import CPUAdam
from cpu_adam.fsdp2 import in_flight, step_behind_forward

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
PRECISIONS = [  # (shard dtype, moments)
    (torch.float32, "fp32"),
    (torch.float32, "bf16"),
    (torch.float32, "8bit"),
    (torch.bfloat16, "bf16"),
    (torch.bfloat16, "8bit"),
]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 40), nn.Linear(40, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, blocks: int = 3, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 33)
        self.blocks = nn.ModuleList(Block(33) for _ in range(blocks))
        self.head = nn.Linear(33, 5)
        self.checkpointed = checkpointed
        self.order: list[int] = list(range(blocks))  # the order the forward runs its blocks in

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        for i in self.order:
            if self.checkpointed:
                h = torch.utils.checkpoint.checkpoint(self.blocks[i], h, use_reentrant=False)
            else:
                h = self.blocks[i](h)
        return self.head(h)


@dataclass(frozen=True)
class Case:
    """One way of training: the shards' dtype and moments, clipping (None, "inside": max_grad_norm, "outside": torch's
    clip_grad_norm_ before the step), and the rest of what a trainer may do."""

    dtype: torch.dtype = torch.bfloat16
    precision: str = "bf16"
    clip: str | None = "inside"
    max_norm: float = 0.05  # small enough to clip every step
    replicas: int = 1  # HSDP over replicas x shards
    reshard_after_forward: bool = True
    checkpointed: bool = False
    frozen: bool = False  # the first block's params frozen
    groups: bool = False  # decay / no-decay groups with their own lr
    accumulate: int = 1  # micro-batches a step, with set_requires_gradient_sync(False) on all but the last
    nonfinite_at: int | None = None  # a step whose grads hold an inf
    partial_forward: bool = False  # between steps, one block's forward alone (an eval of a model part)
    reversed_order: bool = False  # the forward runs the blocks last to first
    prefetch: bool = False  # FSDP2's explicit forward prefetch of the next block
    steps: int = 3
    device: str = "cpu"  # where FSDP2 computes (the shards stay on the host)

    def describe(self) -> str:
        changed = {k: v for k, v in self.__dict__.items() if v != getattr(Case(), k)}
        return ", ".join(f"{k}={v}" for k, v in changed.items()) or "the default case"


def build(case: Case, seed: int = 0) -> tuple[Net, CPUAdam]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(seed)
    model = Net(checkpointed=case.checkpointed).to(case.dtype).to(case.device)
    if case.reversed_order:
        model.order.reverse()
    world_size = torch.distributed.get_world_size()
    if case.replicas > 1:
        shape = (case.replicas, world_size // case.replicas)
        mesh = init_device_mesh(case.device, shape, mesh_dim_names=("r", "s"))
    else:
        mesh = init_device_mesh(case.device, (world_size,))
    policy = dict(
        mesh=mesh,
        offload_policy=CPUOffloadPolicy(pin_memory=case.device == "cuda"),
        reshard_after_forward=case.reshard_after_forward,
    )
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    if case.prefetch:
        for before, after in zip(model.blocks, model.blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
    if case.frozen:
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)
    options: dict[str, Any] = dict(HYPER, state_precision=case.precision, seed=3)
    options["stochastic_rounding"] = case.dtype == torch.bfloat16
    if case.clip == "inside":
        options["max_grad_norm"] = case.max_norm
    params = [p for p in model.parameters() if p.requires_grad]
    if case.groups:
        matrices = [p for p in params if p.dim() == 2]
        vectors = [p for p in params if p.dim() < 2]
        groups = [{"params": matrices}, {"params": vectors, "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.9)}]
        return model, CPUAdam(groups, **options)
    return model, CPUAdam(params, **options)


def batch(case: Case, step: int, micro: int = 0) -> tuple[Tensor, Tensor]:
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x, y = torch.randn(6, 12, generator=g), torch.randn(6, 5, generator=g)
    return x.to(case.dtype).to(case.device), y.to(case.dtype).to(case.device)


def forward_backward(model: Net, case: Case, step: int) -> None:
    for micro in range(case.accumulate):
        model.set_requires_gradient_sync(micro == case.accumulate - 1)
        x, y = batch(case, step, micro)
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        if case.nonfinite_at == step:
            loss = loss * float("inf")
        loss.backward()


def train_step(model: Net, optimizer: CPUAdam, case: Case, step: int) -> None:
    """One step as a trainer writes it: forward and backward, clipping (outside), the step, zero_grad."""
    forward_backward(model, case, step)
    if case.clip == "outside":
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], case.max_norm)
    optimizer.step()
    optimizer.zero_grad()
    if case.partial_forward:
        x, _ = batch(case, step)
        with torch.no_grad():
            model.blocks[1](torch.tanh(torch.zeros(6, 33, dtype=case.dtype, device=case.device) + x.sum()))


def tensors_of(model: nn.Module, optimizer: CPUAdam) -> dict[str, Tensor]:
    """Every tensor the step writes, local shards as they are, by name: weights, moments, scales, step counts."""
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = _local(p)
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor):
                out[f"{name}.{key}"] = _local(value)
    return out


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def raw(t: Tensor) -> Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_same(actual: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual.keys() ^ expected.keys())}"
    for name in expected:
        a, e = actual[name], expected[name]
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {name} {a.dtype}{tuple(a.shape)}"
        differ = (raw(a) != raw(e)).sum()
        assert not differ, f"{what}: {name} differs from the serial step's in {int(differ)} bytes"


def copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def train_both(case: Case, what: str) -> None:
    """Trains the serial pair and the one behind the forward side by side, bitwise equal after every step."""
    serial, serial_opt = build(case)
    ours, our_opt = build(case)
    handle = step_behind_forward(ours, our_opt)
    for step in range(case.steps):
        train_step(serial, serial_opt, case, step)
        train_step(ours, our_opt, case, step)
        handle.wait()
        assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), f"{what}: step {step}")
    if case.nonfinite_at is not None:
        assert our_opt.__dict__.get("skipped_steps") == serial_opt.__dict__.get("skipped_steps") == 1, what
    handle.remove()


@contextlib.contextmanager
def slow_units(seconds: float = 0.05, failing: int | None = None) -> Iterator[list[int]]:
    """Each unit's step waits ``seconds`` first (so that a read that does not wait for it sees the old values); the
    ``failing``-th unit raises instead. Yields the positions of the units stepped, in order."""
    real = in_flight.adam_step_groups
    stepped: list[int] = []

    def delayed(owner: str, groups: Any) -> None:
        time.sleep(seconds)
        if failing is not None and len(stepped) == failing:
            raise RuntimeError("a planted failure")
        real(owner, groups)
        stepped.append(len(stepped))

    in_flight.adam_step_groups = delayed
    try:
        yield stepped
    finally:
        in_flight.adam_step_groups = real


def each_case(base: Case, **options: list[Any]) -> list[Case]:
    return [replace(base, **{key: value}) for key, values in options.items() for value in values]


Check = Callable[[Net, CPUAdam], None]
