"""Pins the offload optimizer's results bit for bit, against references computed in the same run.

Each scenario trains a small LM with a side layer that is used in some micro-batches only, over
steps with 1 to 3 micro-batches, one step whose grads are infinite (skipped), clipping that bites,
and an lr changed between steps. Its results are all the optimizer shows: the device weights
after every step, the norms, the skipped-step count and every tensor of the final state dict
(masters, moments, 8-bit codes and scales, step counts).

No result is recorded in this file: the grads come from torch's matmuls and the clipping from
torch's reductions, whose bits follow the CPU and torch's dispatch (docs/numerics.md, "Across
CPUs"), so bits recorded on one machine hold on that machine only. The references are computed
here, in the same run:

- The host run (the CPU as the device, overlap="none") must be ``plain_results``: the scenario
  stepped without the optimizer, one kernel call per param over its own master, with the grads,
  norms and scale the optimizer documents, on the scalar kernel (``CPU_ADAM_ISA=scalar``'s). This
  keeps what the digests recorded from 0.3.0 (before the offload core was rebuilt as a package of
  rooms, e13737c) guarded: a restructure must leave every bit as it was, and the vector kernel the
  optimizer runs must give the scalar kernel's bits. A change of the kernel's arithmetic made alike
  in every ISA is ``tests/test_kernel.py``'s to catch (against ``cpu_adam.reference``); a change of
  the numerics on purpose changes ``plain_results`` too, and its commit message says why.
- Every other device ("copying": the GPU's code path with the CPU as the device) and overlap must
  give the host run's results, in one process and on two ZeRO ranks, whose host runs are checked
  against ``plain_results`` the same way.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import raw
from offload_helpers import CopyingCPU, batches, lm_loss, make_model
from rank_spawn import run_ranks
from torch import Tensor, nn

from cpu_adam import OffloadOptimizer, ops, quant8
from cpu_adam.offload.layout import FlatLayout, full_to_shard

BUCKET = 1024
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, bucket_size=BUCKET)
# Micro-batches per step, and in which of them the side layer is used.
SCHEDULE = [(1, {0}), (2, {1}), (3, set()), (1, {0}), (2, {0}), (1, set())]
SKIPPED = 3  # the step whose loss is multiplied by inf

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32-clip": dict(max_grad_norm=0.05),
    "bf16-states-clip_grad_norm_": dict(state_precision="bf16", clip=0.05),
    "8bit": dict(state_precision="8bit", max_grad_norm=0.5),
    "bf16-sr-8bit-clip_grad_norm_": dict(
        state_precision="8bit", master_weights_dtype=torch.bfloat16, stochastic_rounding=True, seed=7, clip=0.05
    ),
}
DEVICES = ("cpu", "copying")
OVERLAPS = ("none", "backward")  # stepping during backward must be invisible
VARIANTS = [(device, overlap) for device in DEVICES for overlap in OVERLAPS if (device, overlap) != ("cpu", "none")]
ZERO_CONFIGS = ("fp32-clip", "bf16-sr-8bit-clip_grad_norm_")

Results = list[tuple[str, Any]]  # (name, value) in the order a run produces them


class WithSide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = make_model(0)
        torch.manual_seed(5)
        self.side = nn.Linear(32, 32).to(torch.bfloat16)


def _loss(model: WithSide, tokens: torch.Tensor, use_side: bool) -> torch.Tensor:
    loss = lm_loss(model.lm, tokens)
    if use_side:
        loss = loss + model.side(model.lm.emb(tokens)).float().square().mean()
    return loss


@contextlib.contextmanager
def _device(kind: str) -> Iterator[None]:
    """ "copying": the GPU code path (staging areas, copies down, uploads) with the CPU as the device."""
    from cpu_adam import offload

    if kind == "cpu":
        yield
        return
    original = offload.rooms.DeviceOps
    offload.rooms.DeviceOps = CopyingCPU
    try:
        yield
    finally:
        offload.rooms.DeviceOps = original


def _snapshot(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _state_items(state_dict: dict[str, Any]) -> Results:
    items: Results = [("skipped", state_dict["skipped_steps"]), ("seed", state_dict["seed"])]
    for g, saved in sorted(state_dict["state"].items()):
        for key in sorted(saved):
            items.append((f"{g}.{key}", _snapshot(saved[key])))
    items += [
        (f"group{g}", sorted((k, repr(v)) for k, v in o.items())) for g, o in enumerate(state_dict["param_groups"])
    ]
    return items


def _same(a: Any, b: Any) -> bool:
    """Tensors: dtype, shape and bytes, every NaN as one (conftest.raw); anything else by its repr."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(raw(a.cpu()), raw(b.cpu()))
        )
    return repr(a) == repr(b)


def differences(actual: Results, expected: Results) -> list[str]:
    """The names of the results that differ; empty where every bit is the same."""
    names, expected_names = [n for n, _ in actual], [n for n, _ in expected]
    if names != expected_names:
        return [f"the results themselves: {names} against {expected_names}"]
    return [name for (name, a), (_, b) in zip(actual, expected) if not _same(a, b)]


def assert_same_results(actual: Results, expected: Results) -> None:
    wrong = differences(actual, expected)
    assert not wrong, f"{len(wrong)} of {len(expected)} results differ from the reference's, first: {wrong[:6]}"


def run_scenario(
    name: str,
    device: str,
    *,
    overlap: str = "none",
    process_group: Any = None,
    rank: int = 0,
    world_size: int = 1,
    share: Callable[[int], float] | None = None,
    **extra: Any,
) -> Results:
    """The results of a scenario; ``share(step)``: the device's share of the elements from that step on; ``extra``:
    more of the optimizer's options."""
    options = dict(CONFIGS[name], overlap=overlap, **extra)
    clip = options.pop("clip", None)
    model = WithSide()
    with _device(device):
        opt = OffloadOptimizer(model.parameters(), **HYPER, process_group=process_group, **options)
    data = batches(sum(m for m, _ in SCHEDULE), batch=4 * world_size)
    results: Results = []
    n = 0
    for step, (micro, side_in) in enumerate(SCHEDULE):
        if share is not None:
            opt.device_fraction = share(step)
        for m in range(micro):
            tokens = data[n].chunk(world_size)[rank]
            n += 1
            loss = _loss(model, tokens, m in side_in)
            if step == SKIPPED:
                loss = loss * float("inf")
            loss.backward()
        if clip is not None:
            results.append((f"clip{step}", float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))))
        opt.step()
        opt.zero_grad()
        opt.param_groups[0]["lr"] *= 0.9  # a scheduler between steps
        results.append((f"norm{step}", opt.last_grad_norm))
        results += [(f"w{step}.{i}", _snapshot(p)) for i, p in enumerate(model.parameters())]
    if process_group is None:
        results += [(f"master{i}", _snapshot(m)) for i, m in enumerate(opt.master_weights())]
    results += _state_items(opt.state_dict())
    opt.close()
    return results


@functools.cache
def host_results(name: str) -> Results:
    """The scenario's results on the host (the CPU as the device, no overlap, no share): the reference of the other
    runs of this process."""
    return run_scenario(name, "cpu")


# -- the plain step: the scenario without the offload optimizer ------------------------------------------------------

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}


class PlainAdam:
    """Adam over each param's own flat master and moments, one call of the scalar kernel per param, each param's random
    bits at its place in the one-process layout (``ops.back_to_back``, 256-element places)."""

    def __init__(self, params: list[Tensor], options: dict[str, Any]) -> None:
        self.params = params
        self.master_is_weight = options.get("master_weights_dtype") == torch.bfloat16
        self.stochastic_rounding = bool(options.get("stochastic_rounding", False))
        self.seed = int(options.get("seed", 0))
        self.eight_bit = options.get("state_precision") == "8bit"
        state_dtype = STATE_DTYPES[options.get("state_precision", "fp32")]
        master_dtype = torch.bfloat16 if self.master_is_weight else torch.float32
        self.masters = [p.detach().reshape(-1).to(master_dtype, copy=True) for p in params]
        self.exp_avgs = [torch.zeros(p.numel(), dtype=state_dtype) for p in params]
        self.exp_avg_sqs = [torch.zeros(p.numel(), dtype=state_dtype) for p in params]
        self.scales = [torch.ones(2, quant8.blocks(p.numel())) for p in params]  # an all-zero block's scale is 1
        self.steps = [0] * len(params)
        self.skipped = 0
        self.offsets = ops.back_to_back(params)

    def step(self, grads: dict[int, Tensor], grad_scale: float, lr: float) -> None:
        beta1, beta2 = HYPER["betas"]
        with ops.force_isa("scalar"), torch.no_grad():
            for i, grad in grads.items():
                self.steps[i] += 1
                weights = self.params[i].detach().view(-1)
                ops.adam_step(
                    [self.masters[i]],
                    [grad],
                    [self.exp_avgs[i]],
                    [self.exp_avg_sqs[i]],
                    step=self.steps[i],
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    eps=HYPER["eps"],
                    weight_decay=HYPER["weight_decay"],
                    grad_scale=grad_scale,
                    bf16_outs=None if self.master_is_weight else [weights],
                    stochastic_rounding=self.stochastic_rounding,
                    seed=self.seed,
                    counter_offsets=[ops.group_counter_base(0) + self.offsets[i]],
                    state_scales=[self.scales[i]] if self.eight_bit else None,
                )
                if self.master_is_weight:
                    weights.copy_(self.masters[i])

    def state_dict(self, lr: float, rank: int, world_size: int) -> dict[str, Any]:
        """The state dict format: flat tensors in the one-process layout, zero between params, or this rank's shard
        of them (``layout.full_to_shard``)."""
        shapes = [p.shape for p in self.params]
        numel = self.offsets[-1] + quant8.blocks(shapes[-1].numel()) * quant8.BLOCK
        shard_layout = FlatLayout(shapes, BUCKET, world_size=world_size, rank=rank)

        def flat(tensors: list[Tensor], per: int = 1, padding: float = 0.0) -> Tensor:
            """``padding``: what the entries no param covers hold (the ZeRO pieces' padding between buckets)."""
            full = tensors[0].new_zeros(*tensors[0].shape[:-1], numel // per)
            covered = torch.zeros(numel // per, dtype=torch.bool)
            for offset, t in zip(self.offsets, tensors):
                full[..., offset // per : offset // per + t.shape[-1]] = t
                covered[offset // per : offset // per + t.shape[-1]] = True
            shard, covered = (full_to_shard(t, shard_layout, per=per) for t in (full, covered))
            return torch.where(covered, shard, torch.full_like(shard, padding))

        state = {
            "step": max(self.steps),
            "param_steps": list(self.steps),
            "shapes": [tuple(s) for s in shapes],
            "master": flat(self.masters),
            "exp_avg": flat(self.exp_avgs),
            "exp_avg_sq": flat(self.exp_avg_sqs),
        }
        if self.eight_bit:
            state["state_scales"] = flat(self.scales, per=quant8.BLOCK, padding=1.0)  # as an all-zero block's
        options = {k: v for k, v in HYPER.items() if k != "bucket_size"}
        group = dict(options, lr=lr, adamw_mode=True, params=list(range(len(self.params))))
        return {"state": {0: state}, "param_groups": [group], "seed": self.seed, "skipped_steps": self.skipped}


def _micro_batch_grads(
    model: WithSide, tokens: Tensor, world_size: int, use_side: bool, infinite: bool
) -> list[Tensor | None]:
    """Each param's grad of one micro-batch, the ranks' summed in bf16 as the reduce-scatter sums them; None where
    the param got none."""
    params = list(model.parameters())
    summed: list[Tensor | None] = [None] * len(params)
    for part in tokens.chunk(world_size):
        loss = _loss(model, part, use_side)
        if infinite:
            loss = loss * float("inf")
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        summed = [s if g is None else g if s is None else s + g for s, g in zip(summed, grads)]
    return summed


def _fp32_sum(landings: list[Tensor]) -> Tensor:
    total = landings[0].float()
    for grad in landings[1:]:
        total = total + grad
    return total


def _norm_pieces(shapes: list[torch.Size], world_size: int) -> list[list[slice]]:
    """Each param's parts in the ranks' pieces of its bucket (``FlatLayout.pieces``), as slices of its elements: the
    parts whose norms the ranks take."""
    layouts = [FlatLayout(shapes, BUCKET, world_size=world_size, rank=r) for r in range(world_size)]
    pieces = []
    for i, shape in enumerate(shapes):
        start = layouts[0].offsets[i]
        end = start + shape.numel()
        owned = [layout.pieces[layout.bucket_of[i]] for layout in layouts]
        parts = [(max(start, p.flat), min(end, p.flat + p.numel)) for p in owned]
        pieces.append([slice(lo - start, hi - start) for lo, hi in parts if lo < hi])
    return pieces


def _squared_norm(landings: list[Tensor], pieces: list[slice]) -> float:
    """A param's squared grad norm as the optimizer takes it (window.py): from a single landing in float32, squared
    in float32; from several, of their fp32 sum in float64; each rank's piece apart, the pieces' squares summed."""
    if len(landings) == 1:
        grad, dtype = landings[0].reshape(-1), torch.float32
    else:
        grad, dtype = _fp32_sum(landings).reshape(-1), torch.float64
    return sum(float(torch.linalg.vector_norm(grad[part], dtype=dtype).square()) for part in pieces)


def _clip_grad_norm(norms: list[float], max_norm: float) -> tuple[float, float]:
    """What ``clip_grad_norm_`` returns and multiplies by, over grads whose norms (float32 tensors) are ``norms``."""
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), 2.0)
    return float(total), float(torch.clamp(max_norm / (total + 1e-6), max=1.0))


def plain_results(name: str, *, rank: int = 0, world_size: int = 1) -> Results:
    """The results the scenario must give, computed without the offload optimizer, from what it documents:

    - each param's grad is the fp32 sum of its bucket's landings, one per backward pass that gave it a grad (here
      the side layer has buckets of its own) or, on ZeRO ranks, one per backward pass (the ranks reduce every
      bucket, zeros where no grad came), each the ranks' sum in bf16; a param that got no grad is not stepped;
    - its squared norm is ``_squared_norm``'s; the norm is the root of their float64 sum (divided by the ranks: the
      norm of the ranks' mean); ``clip_grad_norm_`` reads each param's as a float32 number;
    - the kernel's ``grad_scale`` is ``clip_grad_norm_``'s factor, times ``min(1, max_grad_norm / (norm * factor +
      1e-6))`` under ``max_grad_norm``, divided by the ranks; a norm times factor that is not finite skips the step.
    """
    options = dict(CONFIGS[name])
    clip = options.pop("clip", None)
    max_grad_norm = options.pop("max_grad_norm", None)
    model = WithSide()
    params = list(model.parameters())
    adam = PlainAdam(params, options)
    pieces = _norm_pieces([p.shape for p in params], world_size)
    data = batches(sum(m for m, _ in SCHEDULE), batch=4 * world_size)
    lr = HYPER["lr"]
    results: Results = []
    n = 0
    for step, (micro, side_in) in enumerate(SCHEDULE):
        landings: list[list[Tensor]] = [[] for _ in params]
        got: set[int] = set()
        for m in range(micro):
            grads = _micro_batch_grads(model, data[n], world_size, m in side_in, infinite=step == SKIPPED)
            n += 1
            for i, (p, grad) in enumerate(zip(params, grads)):
                if grad is not None:
                    got.add(i)
                    landings[i].append(grad)
                elif world_size > 1:  # the ranks reduce every bucket in every backward
                    landings[i].append(torch.zeros_like(p))
        squares = [_squared_norm(grads, pieces[i]) if grads else 0.0 for i, grads in enumerate(landings)]
        norm = math.sqrt(float(torch.tensor(squares, dtype=torch.float64).sum())) / world_size
        factor = 1.0
        if clip is not None:
            total, factor = _clip_grad_norm([math.sqrt(squares[i]) / world_size for i in sorted(got)], clip)
            results.append((f"clip{step}", total))
        if math.isfinite(norm * factor):
            grad_scale = factor
            if max_grad_norm is not None:
                grad_scale *= min(1.0, max_grad_norm / (norm * factor + 1e-6))
            grad_scale /= world_size
            adam.step({i: _fp32_sum(landings[i]) for i in sorted(got)}, grad_scale, lr)
        else:
            adam.skipped += 1
        lr *= 0.9
        results.append((f"norm{step}", norm))
        results += [(f"w{step}.{i}", _snapshot(p)) for i, p in enumerate(params)]
    if world_size == 1:
        results += [(f"master{i}", m.view(p.shape).clone()) for i, (m, p) in enumerate(zip(adam.masters, params))]
    results += _state_items(adam.state_dict(lr, rank, world_size))
    return results


# -- the tests -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_host_run_is_the_plain_step_bit_for_bit(name: str):
    assert_same_results(host_results(name), plain_results(name))


@pytest.mark.parametrize(("device", "overlap"), VARIANTS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_device_and_overlap_gives_the_host_runs_bits(name: str, device: str, overlap: str):
    assert_same_results(run_scenario(name, device, overlap=overlap), host_results(name))


def _zero_rank(rank: int, world_size: int, out: Path) -> None:
    ranks = dict(process_group=dist.group.WORLD, rank=rank, world_size=world_size)
    wrong = {}
    for name in ZERO_CONFIGS:
        host = run_scenario(name, "cpu", **ranks)
        wrong[f"{name}: the host run against the plain step"] = differences(
            host, plain_results(name, rank=rank, world_size=world_size)
        )
        for device, overlap in VARIANTS:
            variant = run_scenario(name, device, overlap=overlap, **ranks)
            wrong[f"{name}/{device}/{overlap}"] = differences(variant, host)
    torch.save(wrong, out / f"differences{rank}.pt")


@pytest.mark.dist
def test_zero_ranks_give_the_plain_steps_bits_on_every_device_and_overlap(tmp_path: Path):
    run_ranks(_zero_rank, tmp_path, timeout_s=120.0)
    for rank in range(2):
        for run, wrong in torch.load(tmp_path / f"differences{rank}.pt").items():
            assert not wrong, f"rank {rank}, {run}: {len(wrong)} results differ, first: {wrong[:6]}"
