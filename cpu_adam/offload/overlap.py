"""When the CPU step runs: after backward (``"none"``), or during it (``"backward"``), exactly.

``"backward"`` speculates that the step will be taken as it stands when a bucket lands: no
clipping (a scale of 1, the ranks' mean apart), a finite norm, the same hyper-parameters, no
later contribution to the bucket. A worker thread previews each landed bucket's step as its
grads arrive: the kernel writes the new bf16 weights the step would write into a pinned buffer
of the optimizer's (2 bytes per param) and leaves the state alone. At ``step()``, where every
bucket's preview still holds, the previews are uploaded and the state itself is committed by the
worker afterwards (the same kernel calls, now writing masters and moments), while the next
forward runs; a slot whose grads a commit still reads is not reused before it is done. Where any
preview does not hold, they are all dropped and the step runs serially, as with ``"none"``: the
speculation costs no more than the serial step, and nothing it did is visible.

Everything a user can read waits for the commits first (``state_dict``, ``master_weights``,
``load_state_dict``, ``close``), so after ``step()`` returns the state is the serial step's.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .device import DeviceOps
from .layout import FlatLayout
from .link import Landing, Link
from .stepper import Chunk, Stepper, run
from .window import Finished, Window
from .world import World

__all__ = ["MODES", "BackwardOverlap", "NoOverlap", "Worker", "overlap_for"]

MODES = ("none", "backward")
Key = tuple[int, int]


class Worker:
    """One thread running jobs in order; a job's exception is raised by the next ``wait``."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="cpu_adam-overlap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._error is None:
                    job()
            except BaseException as error:
                self._error = error
            finally:
                self._jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def wait_for(self, done: threading.Event) -> None:
        """Returns once ``done`` is set by a job; raises if a job failed first."""
        while not done.wait(0.01):
            if self._error is not None:
                self.wait()

    def wait(self) -> None:
        """Returns once every job submitted so far has run; raises the first error of one."""
        self._jobs.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"cpu_adam.OffloadOptimizer: the overlapped step failed: {error}") from error

    def stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class NoOverlap:
    """The serial step: nothing runs before ``step()``."""

    extra_bytes = 0

    def landed(self, g: int, b: int, landing: Landing) -> None:
        pass

    def before_reuse(self, g: int, b: int) -> None:
        pass

    def settle(self) -> None:
        pass

    def previews(
        self, hypers: list[dict[str, Any] | None], finished: Finished, synced: bool
    ) -> list[Tensor | None] | None:
        return None

    def commit(self, hypers: list[dict[str, Any] | None], finished: Finished) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Preview(NamedTuple):
    epoch: int  # the window it was made in
    hyper: dict[str, Any]
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
        link: Link,
        hyper_of: Callable[[int, float], dict[str, Any]],
    ) -> None:
        self._dev = dev
        self._link = link
        self._world = world
        self._layouts = layouts
        self._window = window
        self._stepper = stepper
        self._hyper_of = hyper_of  # group, scale -> the kernel's hyper-parameters as step() would pass them
        # The weights the previews wrote, in the slots' layout: pinned, as the uploads read it.
        self.buffers = [
            None if layout is None else dev.host_buffer(layout.shard_numel, torch.bfloat16) for layout in layouts
        ]
        self._previews: dict[Key, _Preview] = {}
        self._failed: set[Key] = set()  # previews whose kernel raised: the serial step will say why
        self._order: list[Key] = []  # buckets in the order they landed: the commits go in that order
        self._committed: dict[Key, threading.Event] = {}
        self._worker = Worker()
        weakref.finalize(self, self._worker.stop)  # at exit too: no thread left inside the kernel

    @property
    def extra_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b is not None)

    # -- during backward ----------------------------------------------------------------------

    def landed(self, g: int, b: int, landing: Landing) -> None:
        """A bucket's grads went down: its step is previewed as soon as they are there (first landing only)."""
        key = (g, b)
        if self._window.landings(g, b) != 1:
            self._previews.pop(key, None)  # a second contribution: the preview no longer holds
            return
        self._order.append(key)
        hyper = self._hyper_of(g, 1.0 / self._world.size)
        got = list(self._window.got[g])
        chunk = Chunk(g, b, b + 1)
        members = self._stepper.members_of(chunk)
        preview = _Preview(self._window.epoch, hyper, tuple(got[i] for i in members), self._stored_steps(g, members))
        grads = {key: self._link.buffers[g].tensor}
        calls = self._stepper.calls(chunk, hyper, grads, got, outputs=self.buffers[g].tensor)

        def job() -> None:
            # The copy down has landed; on a GPU it also orders this after the last upload from the buffer.
            self._dev.wait_host(landing.event)
            try:
                run(calls, preview=True)
            except Exception:
                self._failed.add(key)

        self._previews[key] = preview
        self._worker.submit(job)

    def before_reuse(self, g: int, b: int) -> None:
        """Waits until the commit still reading bucket ``b``'s slot is done."""
        done = self._committed.get((g, b))
        if done is not None:
            self._worker.wait_for(done)

    # -- at step() ------------------------------------------------------------------------------

    def settle(self) -> None:
        """Every preview and commit done: the state is the serial step's."""
        self._worker.wait()
        self._committed.clear()

    def previews(
        self, hypers: list[dict[str, Any] | None], finished: Finished, synced: bool
    ) -> list[Tensor | None] | None:
        """The previews' buffers where every bucket's preview holds for the step about to be taken (after
        ``settle``), else None."""
        if synced or self._failed:  # masters taken from weights written since the previews read them
            return None
        expected = self._window.epoch
        for g, layout in enumerate(self._layouts):
            if layout is None or hypers[g] is None:
                continue
            got = finished.got[g]
            for b in range(len(layout.buckets)):
                members = self._stepper.members_of(Chunk(g, b, b + 1))
                if not any(got[i] for i in members):
                    continue
                preview = self._previews.get((g, b))
                if (
                    preview is None
                    or preview.epoch != expected
                    or preview.hyper != hypers[g]
                    or preview.got != tuple(got[i] for i in members)
                    or preview.steps != self._stored_steps(g, members)
                    or self._window.landings(g, b) != 1
                ):
                    return None
        return [None if buffer is None else buffer.tensor for buffer in self.buffers]

    def commit(self, hypers: list[dict[str, Any] | None], finished: Finished) -> None:
        """The state of the previewed step, written by the worker (in the order the buckets landed)."""
        for g, b in self._order:
            if hypers[g] is None or (g, b) not in self._previews:
                continue
            chunk = Chunk(g, b, b + 1)
            calls = self._stepper.calls(chunk, hypers[g], finished.grads, finished.got[g], weights=False)
            self._stepper.advance(chunk, finished.got[g])
            done = threading.Event()
            self._committed[(g, b)] = done

            def job(calls: list[dict[str, Any]] = calls, done: threading.Event = done) -> None:
                run(calls)
                done.set()

            self._worker.submit(job)

    def reset(self) -> None:
        self._previews.clear()
        self._order.clear()
        self._failed.clear()

    def close(self) -> None:
        try:
            self._worker.wait()
        finally:
            self._worker.stop()
        for buffer in self.buffers:
            if buffer is not None:
                buffer.close()

    def _stored_steps(self, g: int, members: list[int]) -> tuple[int, ...]:
        steps = self._stepper.steps(g)
        return tuple(steps[i] for i in members)


def overlap_for(
    mode: str,
    dev: DeviceOps,
    world: World,
    layouts: list[FlatLayout | None],
    window: Window,
    stepper: Stepper,
    link: Link,
    hyper_of: Callable[[int, float], dict[str, Any]],
) -> NoOverlap | BackwardOverlap:
    if mode not in MODES:
        raise ValueError(f"cpu_adam.OffloadOptimizer: overlap must be one of {MODES}, got {mode!r}")
    if mode == "none":
        return NoOverlap()
    return BackwardOverlap(dev, world, layouts, window, stepper, link, hyper_of)
