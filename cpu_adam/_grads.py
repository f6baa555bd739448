"""The backward side of the offload optimizer: which grads a window holds, and when buckets go down.

A post-accumulate-grad hook packs each grad into its bucket's staging area and leaves a
placeholder in ``param.grad`` (``_offloaded_grad.py``). A complete bucket is handed to
``Transfers`` (``_transfers.py``), which takes its params' squared norms and copies it into the
group's pinned host buffer on the side stream.

What a window (the backward passes since the last step) sends down is counted per bucket:
each flush of a bucket is one contribution to its grad. A bucket flushed more than once (a
second micro-batch, a param used in two reentrant-checkpointed segments, a bucket flushed
early to bound device memory) has its earlier contributions folded into an fp32 host
accumulator (allocated on first use: 4 bytes per param) just before the pinned slice is
overwritten, so contributions are summed in fp32, never in bf16. A param that got no grad in
the window is left alone by the step, as torch's optimizers leave it.

The end of a backward pass is seen through a callback queued on each autograd graph task a
hook fired in (reentrant checkpointing runs nested ones): a user backward ends when none of
them is running any more. A backward that raised never runs its callback: the step refuses to
run on its partial grads until ``zero_grad()`` drops them.

With ZeRO (a ``ShardComm``) the staging area holds the whole bucket, which is reduce-scattered
(a sum: the optimizer folds the 1/N of the average into its grad scale) so that only this
rank's piece goes down. Every rank reduces its buckets in one order, the same
on all ranks whatever order their grads come in, so the collectives always pair up.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from ._collectives import ShardComm
from ._device import DeviceOps
from ._group import GroupBuffers
from ._offloaded_grad import OffloadedGrad, placeholder
from ._transfers import Transfers

__all__ = ["GradCollector"]

# Staging areas open at once (partly packed buckets): a bucket whose params do not all arrive
# (unused params, an order unlike the registration order) is flushed early beyond this.
OPEN_BUCKETS = 2


class GradCollector:
    """Collects the grads of the backward passes of one accumulation window on the host."""

    def __init__(
        self, dev: DeviceOps, groups: list[GroupBuffers | None], transfers: Transfers, comm: ShardComm | None = None
    ) -> None:
        self._dev = dev
        self._comm = comm
        self._groups = groups
        self._transfers = transfers
        self.micro = 0  # user backward passes completed in this window
        self._running: set[int] = set()  # graph tasks with our callback queued that have not ended
        self._open: deque[tuple[GroupBuffers, int]] = deque()  # buckets with a staging area, oldest first
        self._hooks = []
        ref = weakref.ref(self)
        for g, group in enumerate(groups):
            for i, p in enumerate(group.params if group is not None else []):
                self._hooks.append(p.register_hook(_make_clearer(weakref.ref(p))))
                self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(ref, g, i)))
        # ZeRO's reduction order: the last bucket first, as backward produces the grads of the
        # last layers first.
        self._sequence = [
            (g, b)
            for g in reversed(range(len(groups)))
            if groups[g] is not None
            for b in reversed(range(len(groups[g].buckets)))
        ]
        self._order = {key: n for n, key in enumerate(self._sequence)}
        self._next = 0  # position in the sequence of the next bucket to reduce in this backward
        self._ready: set[tuple[int, int]] = set()
        self._order_learned = False
        self._filled: list[tuple[int, int]] = []  # the first backward's buckets, in the order they filled
        self.window = 0  # counts resets: placeholders made before the last one are stale
        self._window_sq: list[Tensor | None] | None = None  # once taken, the window is closed to new grads
        self._factors: dict[tuple[int, int], list[Tensor | float]] = {}  # multiplications of placeholder grads

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- backward ---------------------------------------------------------------------------

    def _on_grad(self, g: int, i: int, param: Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if self._dev.is_capturing():
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: backward is being captured in a CUDA graph, but the optimizer's grad "
                "hooks copy to host memory and wait on the host, which a graph cannot hold. Capture the forward "
                "only (torch.cuda.make_graphed_callables on the model's blocks), or train without CUDA graphs"
            )
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: the parameter of shape {tuple(param.shape)} got a {grad.layout} "
                "gradient; the offload optimizer needs dense gradients (e.g. nn.Embedding(..., sparse=False))"
            )
        if self._window_sq is not None:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: a backward ran after the grad norm of this window was taken "
                "(clip_grad_norm_ or a norm of a grad). Take norms and clip after the last backward before step()"
            )
        self._track_graph_task()
        group = self._groups[g]
        b = group.layout.bucket_of[i]
        state = group.buckets[b]
        if self._comm is not None and self._order[(g, b)] < self._next:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: a parameter of shape {tuple(param.shape)} got a second grad in one "
                "backward after its bucket was reduced across the ranks (reentrant activation checkpointing with a "
                "parameter used in several segments, or used both inside and outside one). With a process group, "
                "use torch.utils.checkpoint(..., use_reentrant=False), or keep each parameter in one segment"
            )
        if state.staging is None:
            self._open_bucket(group, b)
        bucket = group.layout.buckets[b]
        lo, hi = group.layout.param_range(i)
        target = state.staging[lo - bucket.start : hi - bucket.start].view(param.shape)
        if i in state.packed:  # a second grad in one backward (reentrant checkpointing): summed
            target.add_(grad)
        else:
            target.copy_(grad)
            state.packed.add(i)
        param.grad = placeholder(param, self, g, i)  # the compute stream orders any reuse after the copy
        group.got[i] = True
        if len(state.packed) == bucket.last - bucket.first:
            self._bucket_complete(g, b)

    def _bucket_complete(self, g: int, b: int) -> None:
        if self._comm is None:
            self._flush(self._groups[g], b)
            return
        # ZeRO: reductions go in one fixed order on every rank (as DDP), whatever order the grads
        # come in, so ranks whose graphs differ still pair the same buckets.
        if not self._order_learned:
            self._filled.append((g, b))
        self._ready.add((g, b))
        while self._next < len(self._sequence) and self._sequence[self._next] in self._ready:
            self._reduce_next()

    def _reduce_next(self) -> None:
        g, b = self._sequence[self._next]
        group = self._groups[g]
        if group.buckets[b].staging is None:
            self._open_bucket(group, b)  # no grad came for it on this rank: zeros
        self._ready.discard((g, b))
        self._next += 1
        self._flush(group, b)

    def _end_backward_in_order(self) -> None:
        """ZeRO, at the end of a user backward: every bucket not reduced yet goes, in order.

        After the first backward every rank takes the order in which rank 0's buckets filled (as
        DDP rebuilds its buckets): a bucket that fills early is reduced early, and device memory
        stays a few buckets, where the initial order (last bucket first) can hold many.
        """
        while self._next < len(self._sequence):
            self._reduce_next()
        self._next = 0
        self._share_got()
        if not self._order_learned:
            self._order_learned = True
            seen = set(self._filled)
            order = self._filled + [key for key in self._sequence if key not in seen]
            index = torch.tensor([self._order[key] for key in order], dtype=torch.int64, device=self._dev.device)
            self._comm.broadcast_from_rank0(index)
            self._sequence = [self._sequence[n] for n in index.tolist()]
            self._order = {key: n for n, key in enumerate(self._sequence)}

    def _share_got(self) -> None:
        """ZeRO: a param that got a grad on any rank has one on every rank (its bucket was reduced), as with DDP.

        So every rank's placeholders are the same, and a clip_grad_norm_ over them the same on every rank.
        """
        flags = torch.tensor(
            [int(x) for group in self._groups if group is not None for x in group.got],
            dtype=torch.int32,
            device=self._dev.device,
        )
        self._comm.all_reduce_max(flags)
        shared = iter(flags.tolist())
        for g, group in enumerate(self._groups):
            for i, param in enumerate(group.params if group is not None else []):
                if next(shared) and not group.got[i]:
                    group.got[i] = True
                    param.grad = placeholder(param, self, g, i)

    def _track_graph_task(self) -> None:
        task = torch._C._current_graph_task_id()
        if task in self._running:
            return
        self._running.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_graph_task(task))

    def _end_graph_task(self, task: int) -> None:
        # A user backward ends when no graph task that packed grads is running any more: the
        # nested ones of reentrant checkpointing end inside it, whichever started first.
        self._running.discard(task)
        if self._comm is None:
            while self._open:
                group, b = self._open[0]
                self._flush(group, b)
        if self._running:
            return
        if self._comm is not None:
            self._end_backward_in_order()
        self.micro += 1

    def _open_bucket(self, group: GroupBuffers, b: int) -> None:
        if len(self._open) >= OPEN_BUCKETS and self._comm is None:
            oldest, ob = self._open[0]
            self._flush(oldest, ob)  # params still to come re-open it: a second contribution
        state = group.buckets[b]
        if state.flushes > 0:
            self._fold(group, b)
        state.staging = self._transfers.staging_area(group, b)
        self._open.append((group, b))

    def _fold(self, group: GroupBuffers, b: int) -> None:
        """Adds the contribution the pinned buffer holds for bucket ``b`` into the fp32 accumulator."""
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
        self._open.remove((group, b))
        bucket = group.layout.buckets[b]
        staging = state.staging
        if staging.untyped_storage().data_ptr() == group.grads.tensor.untyped_storage().data_ptr():
            # The host buffer itself (CPU device): params that did not arrive still hold the last
            # contribution, already folded into the accumulator. Padding is never written.
            for i in range(bucket.first, bucket.last):
                if i not in state.packed:
                    lo, hi = group.layout.param_range(i)
                    staging[lo - bucket.start : hi - bucket.start].zero_()
        state.event = self._transfers.down(group, b, staging, take_norms=state.flushes == 0)
        state.staging = None
        state.packed = set()
        state.flushes += 1

    # -- the step's view of the window ------------------------------------------------------

    @property
    def has_grads(self) -> bool:
        return any(any(g.got) for g in self._groups if g is not None)

    def check_finished(self) -> None:
        """Raises when a backward of this window did not run to its end (it raised half-way)."""
        if self._running:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: a backward pass did not finish (it raised, e.g. out of memory) and "
                "left partial gradients; call optimizer.zero_grad() to drop them before the next step()"
            )

    def wait_all(self) -> None:
        """Returns once every copy down has landed in the host buffers."""
        self._transfers.wait_all()

    def window_sq(self) -> list[Tensor | None]:
        """Each param's squared grad norm of the window (float64, per group), summed over the ranks.

        Taken once per window, after every backward of it (it folds the last contribution of
        buckets flushed several times into the accumulator): a later backward raises.
        """
        if self._window_sq is not None:
            return self._window_sq
        self.check_finished()
        self.wait_all()
        sq = [None if group is None else self._group_sq(group) for group in self._groups]
        if self._comm is not None:
            flat = torch.cat([x for x in sq if x is not None]).to(self._dev.device)
            self._comm.all_reduce_sum(flat)
            parts = iter(flat.cpu().split([len(g.params) for g in self._groups if g is not None]))
            sq = [None if group is None else next(parts) for group in self._groups]
        self._window_sq = sq
        return sq

    def _group_sq(self, group: GroupBuffers) -> Tensor:
        sq = torch.zeros(len(group.params), dtype=torch.float64)
        if group.param_sq is not None:
            sq.copy_(group.param_sq)
        for b, state in enumerate(group.buckets):
            if state.flushes > 1 and group.host_slice(b) is not None:
                where = group.host_slice(b)[1]
                acc = group.accumulator[where]
                acc.add_(group.grads.tensor[where])
                index, slices = group.sq_plan(b)
                if slices:
                    norms = torch._foreach_norm([acc[s] for s in slices], 2, dtype=torch.float64)
                    sq[index.cpu()] = torch.stack(norms).square()
        return sq

    # -- what the placeholder grads ask (see _offloaded_grad.py) ------------------------------

    def grad_norm(self, g: int, i: int) -> float:
        """The 2-norm of param ``i``'s grad in this window (of the ranks' mean with ZeRO)."""
        return math.sqrt(float(self.window_sq()[g][i])) / (1 if self._comm is None else self._comm.world_size)

    def scale_grad(self, g: int, i: int, factor: Tensor | float) -> None:
        self._factors.setdefault((g, i), []).append(factor)

    def grad_factor(self) -> float:
        """What the window's grads were multiplied by (clip_grad_norm_): one factor for all of them."""
        groups = enumerate(self._groups)
        got = [(g, i) for g, group in groups if group is not None for i, x in enumerate(group.got) if x]
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

    def grads_of(self, group: GroupBuffers, b: int) -> Tensor:
        """The window's summed grads of bucket ``b`` (after ``window_sq``), in host-buffer coordinates."""
        return group.accumulator if group.buckets[b].flushes > 1 else group.grads.tensor

    def reset(self) -> None:
        """Forgets the window's grads: the next backward starts a new one."""
        self.micro = 0
        self.window += 1
        self._window_sq = None
        self._factors.clear()
        self._running.clear()
        self._open.clear()
        self._next = 0
        self._ready.clear()
        for group in self._groups:
            if group is None:
                continue
            group.got = [False] * len(group.params)
            group.param_sq = None
            for state in group.buckets:
                if state.staging is not None:
                    self._transfers.drop(state.staging)
                state.staging = None
                state.packed = set()
                state.flushes = 0


def _make_clearer(ref: weakref.ref[Tensor]) -> Callable[[Tensor], None]:
    # Before a grad is accumulated into the param: the placeholder left by the last backward
    # goes, so the new grad is stored as it is rather than added to it.
    def clear(grad: Tensor) -> None:
        param = ref()
        if param is not None and isinstance(param.grad, OffloadedGrad):
            param.grad = None

    return clear


def _make_hook(ref: weakref.ref[GradCollector], g: int, i: int) -> Callable[[Tensor], None]:
    # A weak reference: the hooks live as long as the params, which must not keep the
    # optimizer's host buffers alive.
    def hook(param: Tensor) -> None:
        collector = ref()
        if collector is not None:
            collector._on_grad(g, i, param)

    return hook
