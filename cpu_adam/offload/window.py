"""The accumulation window: the grads of the backward passes since the last step, and what they add up to.

What a window sends down is counted per bucket: each landing of a bucket is one contribution to
its grad. A bucket that lands more than once (a second micro-batch, a param used in two
reentrant-checkpointed segments, a bucket flushed early to bound device memory) has its earlier
contributions folded into an fp32 host accumulator (allocated on first use: 4 bytes per param)
before its slot receives the next, so contributions are summed in fp32, never in bf16. A param
that got no grad in the window is left alone by the step, as torch's optimizers leave it.

Each param's squared norm comes from its first landing (taken on the device, in float32) or, for
a bucket that landed several times, from the accumulator (in float64, on the host: a bucket the
device steps accumulates on the device and its sum comes down for it, so that the norm, and the
clipping, are the same bits wherever the bucket is stepped), summed over the ranks.
``close`` ends the window: the last contributions are folded and the norms taken, once; a later
backward raises. ``finish`` is what the step asks, once: the grads to step, and one scale (the
clipping, the factor ``clip_grad_norm_`` multiplied the placeholders by, the mean over the
ranks) or a skip.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .device import DeviceOps
from .layout import FlatLayout
from .link import Landing, Link
from .share import Share
from .world import World

__all__ = ["ACCUMULATOR_DTYPE", "Finished", "Window", "peer_failed"]

ACCUMULATOR_DTYPE = torch.float32  # contributions of a bucket that lands more than once


class Finished(NamedTuple):
    """A closed window, as the step uses it."""

    norm: float  # of the grads (their mean over the ranks) before any scaling
    scale: float | None  # what the kernel multiplies the grads by; None: skip the step (a non-finite norm)
    got: list[list[bool]]  # per group, per param: whether it got a grad
    grads: dict[tuple[int, int], Tensor]  # per (group, bucket) the host steps: its group's summed grads (host slices)
    device_grads: dict[tuple[int, int], Tensor]  # per bucket the device steps: its piece's summed grads, on the device


class Window:
    def __init__(
        self, dev: DeviceOps, world: World, link: Link, layouts: list[FlatLayout | None], share: Share
    ) -> None:
        self._dev = dev
        self._world = world
        self._link = link
        self._layouts = layouts
        self._share = share
        self.epoch = 0  # counts resets: placeholders made before the last one are stale
        self.micro = 0  # user backward passes completed in this window
        self._in_backward = False
        self.failed_rank: int | None = None  # a rank whose backward raised in this window
        self.got = [[False] * (len(layout.shapes) if layout else 0) for layout in layouts]
        self._landings = {key: 0 for key in link.slots}
        self._norms: list[tuple[int, Landing]] = []  # first landings' norms, on the device
        self._summed, self._partial_sq = 0, 0.0  # of them, those read on the host (whose copies are done), summed
        self.accumulators: list[Tensor | None] = [None] * len(layouts)
        self._device_accumulators: dict[tuple[int, int], Tensor] = {}  # of the buckets the device steps
        self._factors: dict[tuple[int, int], list[Tensor | float]] = {}
        self._sq: list[Tensor | None] | None = None  # once taken, the window is closed to new grads

    # -- filling ----------------------------------------------------------------------------

    def check_open(self) -> None:
        if self._sq is not None:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: a backward ran after the grad norm of this window was taken "
                "(clip_grad_norm_ or a norm of a grad). Take norms and clip after the last backward before step()"
            )

    def got_grad(self, g: int, i: int) -> None:
        self.got[g][i] = True

    def landings(self, g: int, b: int) -> int:
        """Contributions bucket ``b`` received in this window."""
        return self._landings[(g, b)]

    def landed(self, g: int, b: int, landing: Landing) -> None:
        self._landings[(g, b)] += 1
        if landing.sq is not None:
            self._norms.append((g, landing))

    def fold(self, g: int, b: int) -> None:
        """Bucket ``b``'s landed contributions into the accumulator, before its slot receives another."""
        count = self._landings[(g, b)]
        if count == 0 or self._layouts[g].host_slice(b) is None:
            return
        acc, grads = self._accumulator(g, b), self._link.landed(g, b)
        if count == 1:
            acc.copy_(grads)
        else:
            acc.add_(grads)

    def _accumulator(self, g: int, b: int) -> Tensor:
        """Bucket ``b``'s piece of the accumulator: in host RAM, or on the device for a bucket the device steps."""
        where = self._layouts[g].host_slice(b)
        if self._share.on_device(g, b):
            if (g, b) not in self._device_accumulators:
                zeros = torch.zeros(where[1].stop - where[1].start, dtype=ACCUMULATOR_DTYPE, device=self._dev.device)
                self._device_accumulators[(g, b)] = self._dev.hold(zeros)
            return self._device_accumulators[(g, b)]
        if self.accumulators[g] is None:
            self.accumulators[g] = torch.zeros(self._layouts[g].shard_numel, dtype=ACCUMULATOR_DTYPE)
        return self.accumulators[g][where[1]]

    def clips(self, limit: float | None) -> bool:
        """Whether the grads landed so far already pass ``limit``: their squares only add up, so that clipping is
        then certain. Read without waiting, from the norms whose copies are done."""
        while self._summed < len(self._norms) and self._dev.done(self._norms[self._summed][1].event):
            sq = self._norms[self._summed][1].sq_host
            self._partial_sq += 0.0 if sq is None else float(sq.double().sum())
            self._summed += 1
        return limit is not None and math.sqrt(self._partial_sq) / self._world.size > limit

    @property
    def begun(self) -> bool:
        """Whether a backward has sent grads in this window (or is running)."""
        return self._in_backward or any(self._landings.values())

    @property
    def in_backward(self) -> bool:
        return self._in_backward

    def backward_started(self) -> None:
        self._in_backward = True

    def abandoned(self) -> None:
        """This rank's backward raised half-way: the window can no longer step, on any rank."""
        self._in_backward = False
        self.failed_rank = self._world.rank

    def backward_ended(self) -> None:
        self._in_backward = False
        self.micro += 1

    def check_finished(self) -> None:
        """Raises when a backward of this window did not run to its end (it raised half-way), here or on a peer."""
        if self.failed_rank is not None:
            raise peer_failed(self.failed_rank, self._world.size)
        if self._in_backward:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: a backward pass did not finish (it raised, e.g. out of memory) and "
                "left partial gradients; call optimizer.zero_grad() to drop them before the next step()"
            )

    def share_got(self, failed: bool = False) -> list[tuple[int, int]]:
        """At the end of a backward, on every rank: params that got a grad on another rank only (their bucket
        was reduced) have one here too. ``failed``: this rank's backward raised; every rank learns it."""
        keys = [(g, i) for g, got in enumerate(self.got) for i in range(len(got))]
        *shared, failed_rank = self._world.max_over_ranks(
            [int(self.got[g][i]) for g, i in keys] + [self._world.rank + 1 if failed else 0]
        )
        if failed_rank:  # kept until reset(): later backward passes do not make the window whole again
            self.failed_rank = failed_rank - 1
        new = [key for key, any_rank in zip(keys, shared) if any_rank and not self.got[key[0]][key[1]]]
        for g, i in new:
            self.got[g][i] = True
        return new

    @property
    def has_grads(self) -> bool:
        return any(any(got) for got in self.got)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> list[Tensor | None]:
        """Ends the window (once): the last contributions folded; each param's squared norm, summed over the ranks."""
        if self._sq is None:
            self.check_finished()
            self._link.wait_all()
            sq = [None if layout is None else self._group_sq(g, layout) for g, layout in enumerate(self._layouts)]
            summed = iter(self._world.sum_over_ranks([x for x in sq if x is not None]))
            self._sq = [None if x is None else next(summed) for x in sq]
        return self._sq

    def _group_sq(self, g: int, layout: FlatLayout) -> Tensor:
        sq = torch.zeros(len(layout.shapes), dtype=torch.float64)
        landings = [landing for group, landing in self._norms if group == g]
        if landings:
            first = torch.zeros(len(layout.shapes), dtype=torch.float32, device=landings[0].sq.device)
            for landing in landings:
                first.index_copy_(0, landing.params, landing.sq)
            sq.copy_(first)
        for b in range(len(layout.buckets)):
            where = layout.host_slice(b)
            if self._landings[(g, b)] > 1 and where is not None:
                acc = self._accumulator(g, b)
                acc.add_(self._link.landed(g, b))
                params, slices = layout.piece_params(b)
                if slices:
                    acc = acc.cpu()  # a device's accumulator: the norm as the host takes it
                    norms = torch._foreach_norm([acc[s] for s in slices], 2, dtype=torch.float64)
                    sq[params] = torch.stack(norms).square()
        return sq

    def finish(self, max_grad_norm: float | None) -> Finished:
        """The closed window's grads and the step's one scale (None: skip)."""
        factor = self._factor()  # before the wait: a refused clipping raises before anything is waited for
        norm = math.sqrt(sum(float(x.sum()) for x in self.close() if x is not None)) / self._world.size
        scale = None
        if math.isfinite(norm * factor):
            scale = factor
            if max_grad_norm is not None:  # of the grads as the caller left them
                scale *= min(1.0, max_grad_norm / (norm * factor + 1e-6))
            scale /= self._world.size  # the collectives summed the ranks' grads: this makes it their mean
        grads, device_grads = {}, {}
        for (g, b), count in self._landings.items():
            if self._share.on_device(g, b):
                if count and self._layouts[g].host_slice(b) is not None:
                    device_grads[(g, b)] = self._accumulator(g, b) if count > 1 else self._link.landed(g, b)
            else:
                grads[(g, b)] = self.accumulators[g] if count > 1 else self._link.buffers[g].tensor
        return Finished(norm, scale, self.got, grads, device_grads)

    # -- what the placeholder grads ask (see placeholder.py) ----------------------------------

    def grad_norm(self, g: int, i: int) -> float:
        """The 2-norm of param ``i``'s grad in this window (of the ranks' mean)."""
        return math.sqrt(float(self.close()[g][i])) / self._world.size

    def scale_grad(self, g: int, i: int, factor: Tensor | float) -> None:
        self._factors.setdefault((g, i), []).append(factor)

    def _factor(self) -> float:
        """What the window's grads were multiplied by (clip_grad_norm_): one factor for all of them."""
        got = [(g, i) for g, flags in enumerate(self.got) for i, x in enumerate(flags) if x]
        recorded = [self._factors.get(key, []) for key in got]
        if not any(recorded):
            return 1.0
        by_identity = {tuple(f if isinstance(f, (int, float)) else id(f) for f in fs) for fs in recorded}
        values = {math.prod(float(f) for f in fs) for fs in recorded} if len(by_identity) > 1 else None
        if values is not None and len(values) > 1:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: the grads of this optimizer's params were multiplied by different "
                "factors (clip_grad_norm_ over part of its params, or mul_ on some grads). The optimizer scales all "
                "its grads alike: clip over all its params (e.g. model.parameters()), or use max_grad_norm"
            )
        return math.prod(float(f) for f in recorded[0])

    def reset(self) -> None:
        """Forgets the window's grads: the next backward starts a new one."""
        self.epoch += 1
        self.micro = 0
        self._in_backward = False
        self.failed_rank = None
        self._sq = None
        self._factors.clear()
        self._norms.clear()
        self._summed, self._partial_sq = 0, 0.0
        self.got = [[False] * len(got) for got in self.got]
        self._landings = dict.fromkeys(self._landings, 0)
        self._dev.release(list(self._device_accumulators.values()))
        self._device_accumulators.clear()

    @property
    def accumulator_bytes(self) -> int:
        return sum(0 if a is None else a.untyped_storage().nbytes() for a in self.accumulators)


def peer_failed(rank: int, size: int) -> RuntimeError:
    return RuntimeError(
        f"cpu_adam.OffloadOptimizer: the backward of rank {rank} of {size} raised, so this step's grads are "
        "incomplete and no rank steps on them. Call optimizer.zero_grad() on every rank (the failed rank "
        "already must, to catch up) and go on with the next batch"
    )
