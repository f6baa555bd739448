"""The autograd side: hooks that take each grad as backward produces it and pack it into its bucket.

A post-accumulate-grad hook packs a param's grad into its bucket's staging area and leaves a
placeholder in ``param.grad`` (``placeholder.py``). The schedule (``schedule.py``) says when a
bucket is sent; the link (``link.py``) sends it and returns its landing, which goes to the window
(``window.py``). A bucket re-opened in the same window first has its landed contributions folded
by the window, as its slot will receive the next.

The end of a backward pass is seen through a callback queued on each autograd graph task a hook
fired in (reentrant checkpointing runs nested ones): a user backward ends when none of them is
running any more. A backward that raised never runs its callback: the window then refuses to
close on its partial grads until ``zero_grad()`` drops them. With ZeRO the other ranks wait in
the collectives of that backward: ``zero_grad()`` first makes them (``abandon``), saying that this
rank failed, and every rank's backward then raises at its end instead of stepping.

The hooks and the callback run eagerly under ``torch.compile``: a backward called from a compiled
function (a graph break) runs them in that function's thread, where torch.compile would otherwise
trace them, a graph per param, guarded on the optimizer's bookkeeping.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from . import refusals
from .auto import Planner
from .device import DeviceOps
from .device_store import DeviceStore
from .layout import FlatLayout
from .link import Link
from .overlap import BackwardOverlap, NoOverlap
from .placeholder import OffloadedGrad, placeholder
from .schedule import Key, Schedule
from .window import Window

__all__ = ["Hooks"]


class Hooks:
    def __init__(
        self,
        dev: DeviceOps,
        params: list[list[Tensor]],
        layouts: list[FlatLayout | None],
        link: Link,
        window: Window,
        schedule: Schedule,
        overlap: NoOverlap | BackwardOverlap,
        device_store: DeviceStore,
        planner: Planner,
    ) -> None:
        self._dev = dev
        self._params = params
        self._layouts = layouts
        self._link = link
        self._window = window
        self._schedule = schedule
        self._overlap = overlap
        self._device_store = device_store
        self._planner = planner
        self._staging: dict[Key, Tensor] = {}  # buckets being packed since they were last sent
        self._packed: dict[Key, set[int]] = {}  # the params packed into each staging area
        self._running: set[int] = set()  # graph tasks with our callback queued that have not ended
        self._handles = []
        ref = weakref.ref(self)
        for g, ps in enumerate(params):
            for i, p in enumerate(ps):
                self._handles.append(p.register_hook(_make_clearer(weakref.ref(p))))
                self._handles.append(p.register_post_accumulate_grad_hook(_make_hook(ref, g, i)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_grad(self, g: int, i: int, param: Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        refusals.check_not_compiled_autograd()
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
        self._window.check_open()
        self._track_graph_task()
        layout = self._layouts[g]
        key = (g, layout.bucket_of[i])
        if key not in self._staging:
            for early in self._schedule.opening(key, param.shape):
                self._send(early)
            self._open(key)
        bucket = layout.buckets[key[1]]
        lo, hi = layout.param_range(i)
        target = self._staging[key][lo - bucket.start : hi - bucket.start].view(param.shape)
        packed = self._packed[key]
        if i in packed:  # a second grad in one backward (reentrant checkpointing): summed
            target.add_(grad)
        else:
            target.copy_(grad)
            packed.add(i)
        param.grad = placeholder(param, self._window, g, i)  # the compute stream orders any reuse after the copy
        self._window.got_grad(g, i)
        if len(packed) == bucket.last - bucket.first:
            for due in self._schedule.completed(key):
                self._send(due)

    def _open(self, key: Key) -> None:
        self._window.fold(*key)
        self._staging[key] = self._link.staging_area(*key)
        self._packed[key] = set()

    def _send(self, key: Key) -> None:
        if key not in self._staging:
            self._open(key)  # no grad came for it on this rank: zeros
        g, b = key
        staging, packed = self._staging.pop(key), self._packed.pop(key)
        self._schedule.sent(key)
        if self._link.is_slot(g, staging):
            # Params that did not arrive still hold the last contribution, already folded. Padding is never written.
            layout, bucket = self._layouts[g], self._layouts[g].buckets[b]
            for i in range(bucket.first, bucket.last):
                if i not in packed:
                    lo, hi = layout.param_range(i)
                    staging[lo - bucket.start : hi - bucket.start].zero_()
        landing = self._link.down(g, b, staging, take_norms=self._window.landings(g, b) == 0)
        self._window.landed(g, b, landing)
        self._overlap.landed(g, b, landing)
        self._device_store.fetch(key)  # a bucket the device steps whose state streams: it goes up now
        self._planner.landed()

    def _track_graph_task(self) -> None:
        task = torch._C._current_graph_task_id()
        if task in self._running:
            return
        if not self._running:
            self._window.backward_started()
        self._running.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_graph_task(task))

    @torch.compiler.disable
    def _end_graph_task(self, task: int) -> None:
        # A user backward ends when no graph task that packed grads is running any more: the
        # nested ones of reentrant checkpointing end inside it, whichever started first.
        self._running.discard(task)
        for key in self._schedule.graph_task_ended():
            self._send(key)
        if self._running:
            return
        for key in self._schedule.backward_ended():
            self._send(key)
        for g, i in self._window.share_got():  # as with DDP: a grad on any rank is a grad on every rank
            self._params[g][i].grad = placeholder(self._params[g][i], self._window, g, i)
        self._schedule.all_sent()
        self._window.backward_ended()
        self._window.check_finished()  # another rank's backward raised: this one does too

    def abandon(self) -> None:
        """After a backward that raised half-way: the collectives it owed the other ranks, which learn it failed."""
        if not (self._window.in_backward and self._schedule.owes_peers):
            return
        self._window.abandoned()  # once: if a collective fails here, the window still refuses to step
        for key in self._schedule.backward_ended():
            self._send(key)
        self._window.share_got(failed=True)
        self._schedule.all_sent()

    def reset(self) -> None:
        """Drops what was packed and not sent: a new window begins."""
        for staging in self._staging.values():
            self._link.drop(staging)
        self._staging.clear()
        self._packed.clear()
        self._running.clear()
        self._schedule.reset()


def _make_clearer(ref: weakref.ref[Tensor]) -> Callable[[Tensor], None]:
    # Before a grad is accumulated into the param: the placeholder left by the last backward
    # goes, so the new grad is stored as it is rather than added to it.
    @torch.compiler.disable
    def clear(grad: Tensor) -> None:
        param = ref()
        if param is not None and isinstance(param.grad, OffloadedGrad):
            param.grad = None

    return clear


def _make_hook(ref: weakref.ref[Hooks], g: int, i: int) -> Callable[[Tensor], None]:
    # A weak reference: the hooks live as long as the params, which must not keep the
    # optimizer's host buffers alive.
    @torch.compiler.disable
    def hook(param: Tensor) -> None:
        hooks = ref()
        if hooks is not None:
            hooks._on_grad(g, i, param)

    return hook
