"""When the CPU step runs: after backward (``"none"``), or during it (``"backward"``), exactly.

``"backward"`` keeps the state one step behind the weights. A step's state is committed during the
next backward, by one pass per element as each bucket lands: the kernel commits the deferred step
(from the grads kept from it) and, from what it just stored, previews the new step, speculating
that it will be taken as it stands when the bucket lands: no clipping (a scale of 1, the ranks'
mean apart), a finite norm, the same hyper-parameters, no later contribution to the bucket. The
preview's bf16 weights overwrite the kept grads, which the commit has just read, so the grads of
two steps and the weights fit in two pinned bf16 buffers: the link's slots and one more of the
same size (2 bytes per param), which swap roles at each step.

At ``step()``, where every bucket's preview still holds, each bucket's previews are uploaded as
soon as the worker has made them, and the step is deferred (its grads kept, its step counts
taken). Where the grads are those the previews read but the numbers are not (clipping that bites,
a changed hyper-parameter, weights written since), the previews are made again with the step's
numbers, one pass that writes the weights alone, and the step is deferred all the same. Otherwise
(another micro-batch came, a skip) the step runs serially, as with ``"none"``: a failed
speculation costs no more than the serial step, and nothing it did is visible. A step that raises
after some of its buckets went up puts their weights back (each bucket's master, committed by
then, rounded as the kernel rounds it): all or nothing.

Between steps the worker commits the deferred steps ahead, in the order the buckets landed last
time, whenever it has no landing to serve (during the forward, say), so that a bucket whose
commit is done only previews when it lands. ``state_dict``, ``master_weights``,
``load_state_dict`` and ``close`` wait for every commit first, so the state a user can read is
always the serial step's.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ops import NextStep
from .deferred import DeferredSteps
from .device import DeviceOps, HostBuffer
from .layout import FlatLayout
from .link import SLOT_DTYPE, Landing, Link
from .share import Share
from .stepper import Chunk, Stepper, run
from .store import Store
from .window import Finished, Window
from .worker import Worker
from .world import World

__all__ = ["BackwardOverlap", "NoOverlap"]

Key = tuple[int, int]


class NoOverlap:
    """The serial step: nothing runs before ``step()``."""

    extra_bytes = 0
    wait_seconds = 0.0

    def landed(self, g: int, b: int, landing: Landing) -> None:
        pass

    def settle(self) -> None:
        pass

    def upload(self, hypers: list[dict[str, Any] | None], finished: Finished, synced: bool) -> bool:
        return False

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Preview(NamedTuple):
    epoch: int  # the window it was made in
    hyper: dict[str, Any]  # what it speculated
    calls: list[dict[str, Any]]  # its kernel calls (none where this rank's piece holds no param's elements)
    made: bool  # False: not previewed (the last step's numbers were not its previews', or the grads clip)
    got: tuple[bool, ...]  # the bucket's params that had a grad
    steps: tuple[int, ...]


class BackwardOverlap:
    def __init__(
        self,
        dev: DeviceOps,
        world: World,
        layouts: list[FlatLayout | None],
        window: Window,
        stepper: Stepper,
        store: Store,
        link: Link,
        hyper_of: Callable[[int, float], dict[str, Any]],
        share: Share,
        clip_at: Callable[[], float | None],
    ) -> None:
        self._dev = dev
        self._share = share  # its buckets are stepped on the device at step(), not here
        self._clip_at = clip_at  # max_grad_norm now
        self._world = world
        self._layouts = layouts
        self._window = window
        self._stepper = stepper
        self._store = store
        self._link = link
        self._hyper_of = hyper_of  # group, scale -> the kernel's hyper-parameters as step() would pass them
        # The grads of the deferred step, then the previews' weights written over them; pinned, as uploads read it.
        self.spare: list[HostBuffer | None] = [
            None if layout is None else dev.host_buffer(layout.shard_numel, SLOT_DTYPE) for layout in layouts
        ]
        self._deferred = DeferredSteps()  # their grads in the spare buffer
        self._previews: dict[Key, _Preview] = {}
        self._failed: set[Key] = set()  # previews whose kernel raised: made again at step(), which says why
        self._tickets: dict[Key, int] = {}  # this window's landing jobs
        self._landed: list[Key] = []  # this window's first landings, in order
        self._order: list[Key] = []  # the last window's: the order the deferred steps are committed ahead in
        self.remade = 0  # steps whose previews were made again with the step's numbers
        self.wait_seconds = 0.0  # the host's time waiting for the worker's passes
        # Whether backward previews the step: not after a step whose previews read other numbers (a
        # run that clips clips nearly every step), whose backward then only commits.
        self._speculate = True
        ref = weakref.ref(self)  # the thread must not keep the optimizer alive
        self._worker = Worker(
            lambda: (overlap := ref()) is not None and overlap._commit_ahead(), max(1, torch.get_num_threads() - 1)
        )
        weakref.finalize(self, self._worker.stop)  # at exit too: no thread left inside the kernel

    @property
    def extra_bytes(self) -> int:
        return sum(b.nbytes for b in self.spare if b is not None)

    # -- between steps and during backward ----------------------------------------------------

    def _commit_ahead(self) -> bool:
        """The worker's idle work until the next backward's first landing: the deferred steps, in the order their
        buckets are expected to land, are committed before they do.

        Such a bucket's landing then only previews. The forward's time takes work off the backward's
        tail, for the state's bytes moved once more per param committed ahead; once grads land, the
        landings commit the rest in their one pass (on 2 cores, committing ahead during backward too
        made the backward later).
        """
        return not self._landed and self._deferred.run_next(self._order)

    def landed(self, g: int, b: int, landing: Landing) -> None:
        """A bucket's grads went down: the worker commits its deferred step and previews this one."""
        key = (g, b)
        if self._share.on_device(g, b):
            return
        if self._window.landings(g, b) != 1:
            self._previews.pop(key, None)  # a second contribution: the preview no longer holds
            return
        chunk = Chunk(g, b, b + 1)
        members = self._stepper.members_of(chunk)
        got = list(self._window.got[g])
        hyper = self._hyper_of(g, 1.0 / self._world.size)
        steps = tuple(self._stepper.steps(g)[i] for i in members)
        slots = {key: self._link.buffers[g].tensor}
        previewing = self._speculate and not self._window.clips(self._clip_at())  # no preview can hold then
        preview = self._stepper.calls(chunk, hyper, slots, got, outputs=self.spare[g].tensor) if previewing else []
        members_got = tuple(got[i] for i in members)
        self._previews[key] = _Preview(self._window.epoch, hyper, preview, previewing, members_got, steps)
        # Taken now, not when the job runs: a landing of the same bucket before then (the backward
        # after a failed one) must not commit the deferred step a second time.
        commit = self._deferred.take(key)
        fused = _fused(commit, preview)

        def job() -> None:
            # The copy down has landed; on a GPU it also orders this after the last upload from the spare buffer.
            self._dev.wait_host(landing.event)
            try:
                run(commit if fused is None else fused)
            except BaseException:
                if commit:  # a failed commit stays deferred, and its error is raised
                    self._deferred.put(key, commit)
                raise
            if fused is None and preview:
                try:
                    run(preview, preview=True)
                except Exception:
                    self._failed.add(key)

        self._landed.append(key)
        self._tickets[key] = self._worker.submit(job)

    # -- at step() and wherever the state is read -----------------------------------------------

    def settle(self) -> None:
        """Every job done and every deferred step committed: the state is the serial step's."""
        self._wait(idle=True)
        self._deferred.run_all()

    def _wait(self, ticket: int | None = None, *, idle: bool = False) -> None:
        t = time.perf_counter()
        try:
            self._worker.wait(ticket, idle=idle)
        except BaseException:
            self._previews.clear()  # a retried step() runs serially
            raise
        finally:
            self.wait_seconds += time.perf_counter() - t

    def upload(self, hypers: list[dict[str, Any] | None], finished: Finished, synced: bool) -> bool:
        """Uploads the previews as the step's weights, where they hold, and defers its state; False: they do not
        hold, and the caller takes the step serially (the state is settled).

        A bucket goes up as soon as the worker has previewed it (in the order the buckets landed),
        so the uploads overlap the rest of the worker's passes. Where the grads are those the
        previews read but the numbers are not (a clipping scale, a changed hyper-parameter, masters
        taken from weights written since), the previews are made again with the step's: one pass
        that reads the state and the grads and writes the weights, instead of the step, each
        chunk's uploads overlapping the next chunk's pass. If anything raises, the buckets already
        uploaded get their weights back: all or nothing.
        """
        held = self._held(hypers, finished)
        if held is None:
            self.settle()
            return False
        keys, differ, unmade = held
        self._speculate = not differ
        if unmade:  # the backward did not preview (the step clips): serially, as with "none", in one pass
            self.settle()
            return False
        remake = differ or synced
        if remake:
            self.settle()
            self.remade += 1
        uploaded: list[Key] = []
        try:
            for key in self._made_again(hypers, finished, keys) if remake else self._previewed(hypers, finished, keys):
                g, b = key
                self._link.up(g, b, finished.got[g], self.spare[g].tensor)
                uploaded.append(key)
            self.settle()  # the buckets that did not land commit their deferred steps before the buffers move
        except BaseException:
            self._restore(uploaded, finished.got)
            raise
        self._defer(hypers, finished, remake)
        return True

    def _held(self, hypers: list[dict[str, Any] | None], finished: Finished) -> tuple[list[Key], bool, bool] | None:
        """The buckets to upload, whether a preview read other numbers than the step's, and whether one was not
        made (backward only committed); None where they do not hold.

        They do not where a bucket's grads are not what its preview read (it had none, another
        landing came, params got grads or step counts since).
        """
        keys, differ, unmade = [], False, False
        for g, layout in enumerate(self._layouts):
            if layout is None or hypers[g] is None:
                continue
            got = finished.got[g]
            for b in range(len(layout.buckets)):
                members = self._stepper.members_of(Chunk(g, b, b + 1))
                if self._share.on_device(g, b) or not any(got[i] for i in members):
                    continue
                preview = self._previews.get((g, b))
                if (
                    preview is None
                    or preview.epoch != self._window.epoch
                    or preview.got != tuple(got[i] for i in members)
                    or preview.steps != tuple(self._stepper.steps(g)[i] for i in members)
                    or self._window.landings(g, b) != 1
                ):
                    return None
                keys.append((g, b))
                differ = differ or preview.hyper != hypers[g]
                unmade = unmade or not preview.made
        return keys, differ, unmade

    def _previewed(self, hypers: list[dict[str, Any] | None], finished: Finished, keys: list[Key]) -> Iterator[Key]:
        """The buckets, each once the worker has previewed it: in the order they landed (with ZeRO, the ranks'
        one order of the buckets, as every rank uploads through the same collectives)."""
        landed = {key: i for i, key in enumerate(self._landed)}
        for key in keys if self._world.size > 1 else sorted(keys, key=landed.__getitem__):
            self._wait(self._tickets[key])
            if key in self._failed:  # its commit ran: the preview is made here
                g, b = key
                self._preview_chunk(Chunk(g, b, b + 1), hypers[g], finished)
            yield key

    def _made_again(self, hypers: list[dict[str, Any] | None], finished: Finished, keys: list[Key]) -> Iterator[Key]:
        """The buckets, each once made again with the step's numbers, a chunk (one kernel call) at a time."""
        wanted = set(keys)
        for g, hyper in enumerate(hypers):
            for chunk in self._stepper.chunks[g] if hyper is not None else []:
                self._preview_chunk(chunk, hyper, finished)
                yield from (key for key in ((g, b) for b in range(chunk.first, chunk.last)) if key in wanted)

    def _preview_chunk(self, chunk: Chunk, hyper: dict[str, Any], finished: Finished) -> None:
        outputs = self.spare[chunk.group].tensor
        run(self._stepper.calls(chunk, hyper, finished.grads, finished.got[chunk.group], outputs=outputs), preview=True)

    def _restore(self, uploaded: list[Key], got: list[list[bool]]) -> None:
        """The buckets whose new weights went up get back those they had: their masters (committed), rounded."""
        for g, b in uploaded:
            where = self._layouts[g].host_slice(b)
            if where is not None:
                self.spare[g].tensor[where[1]].copy_(self._store.master(g, where[1]))
            self._link.up(g, b, got[g], self.spare[g].tensor)
        self._previews.clear()

    def _defer(self, hypers: list[dict[str, Any] | None], finished: Finished, remade: bool) -> None:
        """The step just uploaded from the previews: its state is committed ahead of the next backward, or by it.

        Its kernel calls are those of the previews taken, less their bf16 outputs: the same state,
        grads, step counts and numbers (made here where the previews were made again), so that the
        worker takes the interpreter's lock for a call, not to build one.
        """
        for g, layout in enumerate(self._layouts):
            if layout is None or hypers[g] is None:
                continue
            # The grads stay for the commit; the previews' weights, uploaded, become the slots.
            self.spare[g] = self._link.swap_buffer(g, self.spare[g])
            steps = list(self._stepper.steps(g))
            for b in range(len(layout.buckets)):
                chunk = Chunk(g, b, b + 1)
                if not self._share.on_device(g, b) and any(finished.got[g][i] for i in self._stepper.members_of(chunk)):
                    if remade:
                        grads = {(g, b): self.spare[g].tensor}
                        got = finished.got[g]
                        commit = self._stepper.calls(chunk, hypers[g], grads, got, weights=False, steps=steps)
                    else:
                        commit = [{**call, "bf16_outs": None} for call in self._previews[(g, b)].calls]
                    self._deferred.put((g, b), commit)
                    self._stepper.advance(chunk, finished.got[g])
        self._stepper.forget_lists()
        self._order = list(self._landed)

    def reset(self) -> None:
        self._previews.clear()
        self._failed.clear()
        self._tickets.clear()
        self._landed.clear()
        self._worker.wake()  # a new window: the deferred steps are committed ahead until its first landing

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self._worker.stop()
            for buffer in self.spare:
                if buffer is not None:
                    buffer.close()


def _fused(commit: list[dict[str, Any]], preview: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The commit and the preview as one pass (``adam_step(..., then=...)``) where they step the same tensors."""
    if len(commit) != 1 or len(preview) != 1:
        return None
    c, p = commit[0], preview[0]
    for name in ("params", "exp_avgs", "exp_avg_sqs", "state_scales"):
        if len(c[name]) != len(p[name]) or not all(_same_view(a, b) for a, b in zip(c[name], p[name])):
            return None
    if any(c[name] != p[name] for name in ("counter_offsets", "seed", "stochastic_rounding")):
        return None
    scalars = ("lr", "beta1", "beta2", "eps", "weight_decay", "adamw_mode", "grad_scale")
    then = NextStep(p["grads"], p["step"], **{name: p[name] for name in scalars})
    return [{**c, "bf16_outs": p["bf16_outs"], "then": then}]


def _same_view(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
