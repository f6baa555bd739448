"""When the CPU step runs: after backward (``"none"``), or during it (``"backward"``), exactly.

``"backward"`` keeps the state one step behind the weights. A step's state is committed during the
next backward, by one pass per element as each bucket lands: the kernel commits the deferred step
(from the grads kept from it) and, from what it just stored, previews the new step, speculating
that it will be taken as it stands when the bucket lands: no clipping (a scale of 1, the ranks'
mean apart), a finite norm, the same hyper-parameters, no later contribution to the bucket. The
preview's bf16 weights overwrite the kept grads, which the commit has just read, so the grads of
two steps and the weights fit in two pinned bf16 buffers: the link's slots and one more of the
same size (2 bytes per param), which swap roles at each step.

At ``step()``, where every bucket's preview still holds, the previews are uploaded and the step is
deferred (its grads kept, its step counts taken). Where the grads are those the previews read but
the numbers are not (clipping that bites, a changed hyper-parameter, weights written since), the
previews are made again with the step's numbers, one pass that writes the weights alone, and the
step is deferred all the same. Otherwise (another micro-batch came, a skip) the step runs serially,
as with ``"none"``: a failed speculation costs no more than the serial step, and nothing it did is
visible. A bucket that did not land commits at the
next ``step()``; ``state_dict``, ``master_weights``, ``load_state_dict`` and ``close`` commit
everything first, so the state a user can read is always the serial step's.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor

from ..ops import NextStep
from .device import DeviceOps, HostBuffer
from .layout import FlatLayout
from .link import SLOT_DTYPE, Landing, Link
from .stepper import Chunk, Stepper, run
from .window import Finished, Window
from .world import World

__all__ = ["BackwardOverlap", "NoOverlap", "Worker"]

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

    def settle(self) -> None:
        pass

    def previews(self, hypers: list[dict[str, Any] | None], finished: Finished, synced: bool) -> list[Tensor] | None:
        return None

    def defer(self, hypers: list[dict[str, Any] | None], finished: Finished) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Preview(NamedTuple):
    epoch: int  # the window it was made in
    hyper: dict[str, Any]  # what it speculated
    made: bool  # False: not made (the last step's previews read other numbers), only its grads noted
    got: tuple[bool, ...]  # the bucket's params that had a grad
    steps: tuple[int, ...]


class _Deferred(NamedTuple):
    """A step whose state is not written yet: its grads are in the spare buffer."""

    hyper: dict[str, Any]
    got: list[bool]
    steps: list[int]  # the params' counts before it


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
        self._world = world
        self._layouts = layouts
        self._window = window
        self._stepper = stepper
        self._link = link
        self._hyper_of = hyper_of  # group, scale -> the kernel's hyper-parameters as step() would pass them
        # The grads of the deferred step, then the previews' weights written over them; pinned, as uploads read it.
        self.spare: list[HostBuffer | None] = [
            None if layout is None else dev.host_buffer(layout.shard_numel, SLOT_DTYPE) for layout in layouts
        ]
        self._deferred: dict[Key, _Deferred] = {}
        self._previews: dict[Key, _Preview] = {}
        self._failed: set[Key] = set()  # previews whose kernel raised: made again at step(), which says why
        self.remade = 0  # steps whose previews were made again with the step's numbers
        # Whether backward previews the step: not after a step whose previews read other numbers (a
        # run that clips clips nearly every step), whose backward then only commits.
        self._speculate = True
        self._worker = Worker()
        weakref.finalize(self, self._worker.stop)  # at exit too: no thread left inside the kernel

    @property
    def extra_bytes(self) -> int:
        return sum(b.nbytes for b in self.spare if b is not None)

    # -- during backward ----------------------------------------------------------------------

    def landed(self, g: int, b: int, landing: Landing) -> None:
        """A bucket's grads went down: the worker commits its deferred step and previews this one."""
        key = (g, b)
        if self._window.landings(g, b) != 1:
            self._previews.pop(key, None)  # a second contribution: the preview no longer holds
            return
        chunk = Chunk(g, b, b + 1)
        members = self._stepper.members_of(chunk)
        got = list(self._window.got[g])
        hyper = self._hyper_of(g, 1.0 / self._world.size)
        steps = tuple(self._stepper.steps(g)[i] for i in members)
        self._previews[key] = _Preview(
            self._window.epoch, hyper, self._speculate, tuple(got[i] for i in members), steps
        )
        slots = {key: self._link.buffers[g].tensor}
        preview = self._stepper.calls(chunk, hyper, slots, got, outputs=self.spare[g].tensor) if self._speculate else []
        # Taken now, not when the job runs: a landing of the same bucket before then (the backward
        # after a failed one) must not commit the deferred step a second time.
        deferred = self._deferred.pop(key, None)
        commit = [] if deferred is None else self._commit_calls(key, deferred)
        fused = _fused(commit, preview)

        def job() -> None:
            # The copy down has landed; on a GPU it also orders this after the last upload from the spare buffer.
            self._dev.wait_host(landing.event)
            try:
                run(commit if fused is None else fused)
            except BaseException:
                if deferred is not None:  # a failed commit stays deferred, and its error is raised
                    self._deferred[key] = deferred
                raise
            if fused is None and preview:
                try:
                    run(preview, preview=True)
                except Exception:
                    self._failed.add(key)

        self._worker.submit(job)

    def _commit_calls(self, key: Key, deferred: _Deferred) -> list[dict[str, Any]]:
        g, b = key
        grads = {key: self.spare[g].tensor}
        return self._stepper.calls(
            Chunk(g, b, b + 1), deferred.hyper, grads, deferred.got, weights=False, steps=deferred.steps
        )

    # -- at step() and wherever the state is read -----------------------------------------------

    def settle(self) -> None:
        """Every job done and every deferred step committed: the state is the serial step's."""
        self._worker.wait()
        for key, deferred in list(self._deferred.items()):
            run(self._commit_calls(key, deferred))
            del self._deferred[key]

    def previews(self, hypers: list[dict[str, Any] | None], finished: Finished, synced: bool) -> list[Tensor] | None:
        """The previews' buffers, holding the weights of the step about to be taken (after ``settle``), or None.

        None where a bucket's grads are not what its preview read (it had none, another landing came,
        params got grads or step counts since). Where they are but the previews read other numbers (a
        clipping scale, a changed hyper-parameter, masters taken from weights written since, a
        preview that raised), they are made again with the step's: one pass that reads the state
        and the grads and writes the weights, instead of the step.
        """
        differ = False
        again = synced or bool(self._failed)
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
                    or preview.epoch != self._window.epoch
                    or preview.got != tuple(got[i] for i in members)
                    or preview.steps != tuple(self._stepper.steps(g)[i] for i in members)
                    or self._window.landings(g, b) != 1
                ):
                    return None
                differ = differ or preview.hyper != hypers[g]
                again = again or not preview.made
        self._speculate = not differ
        if again or differ:
            self.remade += 1
            for g, hyper in enumerate(hypers):
                for chunk in self._stepper.chunks[g] if hyper is not None else []:
                    calls = self._stepper.calls(
                        chunk, hyper, finished.grads, finished.got[g], outputs=self.spare[g].tensor
                    )
                    run(calls, preview=True)
        return [None if buffer is None else buffer.tensor for buffer in self.spare]

    def defer(self, hypers: list[dict[str, Any] | None], finished: Finished) -> None:
        """The step just uploaded from the previews: its state is committed by the next backward (or ``settle``)."""
        for g, layout in enumerate(self._layouts):
            if layout is None or hypers[g] is None:
                continue
            steps = list(self._stepper.steps(g))
            for b in range(len(layout.buckets)):
                chunk = Chunk(g, b, b + 1)
                if any(finished.got[g][i] for i in self._stepper.members_of(chunk)):
                    self._deferred[(g, b)] = _Deferred(hypers[g], list(finished.got[g]), steps)
                    self._stepper.advance(chunk, finished.got[g])
            # The grads stay for the commit; the previews' weights, uploaded, become the slots.
            self.spare[g] = self._link.swap_buffer(g, self.spare[g])
        self._stepper.forget_lists()

    def reset(self) -> None:
        self._previews.clear()
        self._failed.clear()

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
