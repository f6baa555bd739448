"""The backward side of the offload optimizer: per-group buffers, and grads from device to host.

A post-accumulate-grad hook packs each grad into its bucket's staging area and frees the grad
at once. A complete bucket has its squared norm taken on the device and is copied down, on a
side stream, into the group's pinned bf16 buffer; its staging area is freed only once the
host has seen the copy's event complete, and at most ``max_inflight`` copies stay pending,
which bounds device memory for grads by a few buckets.

Every backward sends every bucket down exactly once: the end-of-backward callback flushes the
buckets some of whose params got no grad, with zeros for those. From the second backward of an
accumulation window on, the grads the previous backward left in the pinned buffer are folded
into an fp32 host accumulator (allocated on first use: 4 bytes per param) just before they are
overwritten, so micro-batches are summed in fp32, never in bf16.

With ZeRO (a ``ShardComm``) the staging area always holds the whole bucket on the device; the
flush reduce-scatters it (a sum: the optimizer folds the 1/N of the average into its grad
scale) and only this rank's piece goes down. Every rank must flush its buckets in the same
order for the collectives to pair up; ``launch_order`` fingerprints the order so the step can
check it.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._collectives import ShardComm
from ._device import DeviceOps, Event
from ._flat import FlatLayout
from ._pinned import HostBuffer

__all__ = ["GradCollector", "GroupBuffers"]


@dataclass
class BucketState:
    staging: Tensor | None = None  # grads being packed during the current backward
    flushes: int = 0  # backward passes of this accumulation window that sent this bucket down
    arrived: int = 0  # params of the bucket whose grad the current backward packed
    event: Event = None  # completion of its last copy down


class GroupBuffers:
    """One param group: its flat device buffer, and the host buffers for this process's shard."""

    def __init__(
        self,
        params: list[Tensor],
        dev: DeviceOps,
        bucket_size: int,
        master_dtype: torch.dtype,
        state_dtype: torch.dtype,
        *,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        self.params = params
        self.layout = layout = FlatLayout([p.shape for p in params], bucket_size, world_size=world_size, rank=rank)
        self.flat = torch.zeros(layout.numel, dtype=torch.bfloat16, device=dev.device)
        with torch.no_grad():
            for i, p in enumerate(params):
                lo, hi = layout.param_range(i)
                self.flat[lo:hi].copy_(p.detach().reshape(-1))
                p.data = self.flat[lo:hi].view(p.shape)
        n = layout.shard_numel
        # Filled from the device weights at the first step, so weights loaded into the model
        # after the optimizer was built are the ones trained.
        self.master = torch.zeros(n, dtype=master_dtype)
        self.master_synced = False
        self.exp_avg = torch.zeros(n, dtype=state_dtype)
        self.exp_avg_sq = torch.zeros(n, dtype=state_dtype)
        self.grads: HostBuffer = dev.host_buffer(n, torch.bfloat16)  # grads down, then weights up
        self.accumulator: Tensor | None = None
        self.buckets = [BucketState() for _ in layout.buckets]
        self.arrived = [False] * len(params)
        self.step = 0

    def host_slice(self, b: int) -> tuple[slice, slice] | None:
        """(slice of the bucket's staging area, slice of the host buffers) of this rank's piece."""
        piece = self.layout.pieces[b]
        if piece.numel == 0:
            return None
        start = piece.flat - self.layout.buckets[b].start
        return slice(start, start + piece.numel), slice(piece.host, piece.host + piece.numel)

    def device_pieces(self) -> list[tuple[Tensor, slice]]:
        """(view of the flat device weights, slice of the host buffers) for each of this rank's pieces."""
        return [(self.flat[p.flat : p.flat + p.numel], slice(p.host, p.host + p.numel)) for p in self.layout.pieces]


class GradCollector:
    """Collects the grads of the backward passes of one accumulation window on the host."""

    def __init__(
        self, dev: DeviceOps, groups: list[GroupBuffers | None], max_inflight: int, comm: ShardComm | None = None
    ) -> None:
        self._dev = dev
        self._comm = comm
        self.launch_order = 0  # a hash of the (group, bucket) sequence reduced in this window
        self._groups = groups
        self._max_inflight = max_inflight
        self.micro = 0  # backward passes in the current accumulation window
        self._callback_queued = False
        self._sq_norm: Tensor | None = None  # on the device: the buckets' squared norms, summed
        self._inflight: deque[tuple[Event, list[Tensor]]] = deque()
        self.device_bytes = 0
        self.device_peak_bytes = 0
        self._hooks = []
        ref = weakref.ref(self)
        for g, group in enumerate(groups):
            for i, p in enumerate(group.params if group is not None else []):
                self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(ref, g, i)))
        self._index = {id(group): g for g, group in enumerate(groups)}

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_grad(self, g: int, i: int, param: Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: the parameter of shape {tuple(param.shape)} got a {grad.layout} "
                "gradient; the offload optimizer needs dense gradients (e.g. nn.Embedding(..., sparse=False))"
            )
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_queued = True
        group = self._groups[g]
        b = group.layout.bucket_of[i]
        bucket, state = group.layout.buckets[b], group.buckets[b]
        if state.staging is None:
            self._open(group, b)
        lo, hi = group.layout.param_range(i)
        state.staging[lo - bucket.start : hi - bucket.start].view(param.shape).copy_(grad)
        param.grad = None  # the compute stream orders any reuse of this memory after the copy
        group.arrived[i] = True
        state.arrived += 1
        if state.arrived == bucket.last - bucket.first:
            self._flush(group, b)

    def _open(self, group: GroupBuffers, b: int) -> None:
        state = group.buckets[b]
        if state.flushes > 0:
            self._fold(group, b)
        bucket = group.layout.buckets[b]
        where = group.host_slice(b)
        if self._comm is None and where is not None and where[0] == slice(0, bucket.numel):
            # On the CPU the staging area is the host buffer itself: no copy down.
            state.staging = self._dev.staging(group.grads.tensor[where[1]])
        else:
            # ZeRO: the whole bucket is packed on the device, for the reduce-scatter.
            state.staging = torch.zeros(bucket.numel, dtype=torch.bfloat16, device=self._dev.device)
        self._count_device(state.staging)

    def _fold(self, group: GroupBuffers, b: int) -> None:
        """Adds the grads the previous backward left in the pinned buffer into the fp32 accumulator."""
        state = group.buckets[b]
        where = group.host_slice(b)
        if where is None:
            return
        self._dev.wait_host(state.event)
        if group.accumulator is None:
            group.accumulator = torch.zeros(group.layout.shard_numel, dtype=torch.float32)
        acc, grads = group.accumulator[where[1]], group.grads.tensor[where[1]]
        if state.flushes == 1:
            acc.copy_(grads)
        else:
            acc.add_(grads)

    def _flush(self, group: GroupBuffers, b: int) -> None:
        state = group.buckets[b]
        if state.staging is None:
            self._open(group, b)
        bucket = group.layout.buckets[b]
        staging = state.staging
        for i in range(bucket.first, bucket.last):
            if not group.arrived[i]:
                lo, hi = group.layout.param_range(i)
                staging[lo - bucket.start : hi - bucket.start].zero_()
        where = group.host_slice(b)
        held = [staging]
        with self._dev.side_stream():
            if self._sq_norm is None:
                self._sq_norm = torch.zeros((), dtype=torch.float32, device=self._dev.device)
            mine = staging if where is None else staging[where[0]]
            if self._comm is not None and bucket.numel > 0:
                self.launch_order = (self.launch_order * 1_000_003 + self._index[id(group)] * 65_537 + b) % (1 << 61)
                # On the CPU the reduced piece lands in the host buffer; on a GPU in a device
                # tensor (not in place in the staging area: gloo does not promise that works).
                if self._dev.host_addressable:
                    mine = group.grads.tensor[where[1]]
                else:
                    mine = torch.empty_like(staging[where[0]])
                    held.append(self._count_device(mine))
                self._comm.reduce_scatter(mine, staging)
            self._sq_norm += torch.linalg.vector_norm(mine, dtype=torch.float32).square()
            if where is not None:
                self._dev.copy(group.grads.tensor[where[1]], mine)
            state.event = self._dev.record()
        state.staging = None
        state.arrived = 0
        state.flushes += 1
        self._inflight.append((state.event, held))
        self._reap(self._max_inflight)

    def _count_device(self, t: Tensor) -> Tensor:
        if not self._dev.host_addressable:
            self.device_bytes += t.numel() * t.element_size()
            self.device_peak_bytes = max(self.device_peak_bytes, self.device_bytes)
        return t

    def _reap(self, keep: int) -> None:
        """Frees staging areas whose copy is done; waits for the oldest beyond ``keep`` pending."""
        while self._inflight and (len(self._inflight) > keep or self._dev.done(self._inflight[0][0])):
            event, held = self._inflight.popleft()
            self._dev.wait_host(event)
            if not self._dev.host_addressable:
                self.device_bytes -= sum(t.numel() * t.element_size() for t in held)

    def _end_backward(self) -> None:
        self._callback_queued = False
        for group in self._groups:
            if group is None:
                continue
            for b, state in enumerate(group.buckets):
                if state.flushes <= self.micro:
                    self._flush(group, b)
            group.arrived = [False] * len(group.params)
        self.micro += 1

    def wait_all(self) -> None:
        """Returns once every copy down has landed in the host buffers."""
        self._reap(0)

    def sq_norm(self) -> float:
        """This rank's squared grad norm of the window (after ``wait_all``); folds in the last backward.

        With ZeRO: of its pieces of the grads summed over ranks.
        """
        sq = self._sq_norm.item()
        if self.micro == 1 or not math.isfinite(sq):
            return sq
        # The norm of a sum is not the sum of the micro-batches' norms: take it on the host.
        total = 0.0
        for group in self._groups:
            if group is not None:
                group.accumulator.add_(group.grads.tensor)
                total += torch.linalg.vector_norm(group.accumulator, dtype=torch.float64).item() ** 2
        return total

    def grads_of(self, group: GroupBuffers) -> Tensor:
        """The window's summed grads of a group (after ``norm``)."""
        return group.accumulator if self.micro > 1 else group.grads.tensor

    def reset(self) -> None:
        """Forgets the window's grads: the next backward starts a new one."""
        self.micro = 0
        self._sq_norm = None
        self.launch_order = 0
        for group in self._groups:
            if group is not None:
                group.arrived = [False] * len(group.params)
                for state in group.buckets:
                    if state.staging is not None and not self._dev.host_addressable:
                        self.device_bytes -= state.staging.numel() * state.staging.element_size()
                    state.staging = None
                    state.arrived = 0
                    state.flushes = 0


def _make_hook(ref: weakref.ref[GradCollector], g: int, i: int) -> Callable[[Tensor], None]:
    # A weak reference: the hooks live as long as the params, which must not keep the
    # optimizer's host buffers alive.
    def hook(param: Tensor) -> None:
        collector = ref()
        if collector is not None:
            collector._on_grad(g, i, param)

    return hook
