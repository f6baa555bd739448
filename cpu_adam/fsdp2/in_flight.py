"""A step in flight: a host thread steps the units one after another, in the order the next forward gathers
them, while the thread that called ``step()`` runs that forward.

Each unit's step is all or nothing (``adam_step_groups``: every kernel call checked before any runs, the
counts advanced with the tensors). A unit that raises ends the step: the units after it are left as they
were, and the failure waits for the first caller of ``wait``/``wait_all`` to collect it. A wait for a unit
the thread has not reached moves that unit to the front, so that a forward gathering units in another
order than the last one waits for its own unit and the one being stepped, no more.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Executor
from enum import Enum

import torch
from torch import Tensor

from .._compiled_step import GroupStep, adam_step_groups

__all__ = ["InFlight", "Status"]


class Status(Enum):
    QUEUED = "queued"
    STEPPING = "stepping"
    STEPPED = "stepped"
    FAILED = "failed"
    LEFT = "left as it was"  # after a failure


class InFlight:
    """The units' steps, queued on the ``stepper``'s thread (``threads`` kernel threads) as soon as it is made."""

    def __init__(
        self, steps: Sequence[Sequence[GroupStep]], names: Sequence[str], threads: int, stepper: Executor
    ) -> None:
        self.names = list(names)
        self.status = [Status.QUEUED] * len(steps)
        self.seconds = [0.0] * len(steps)  # each unit's kernel time, for the benchmarks
        self.failure: tuple[int, BaseException] | None = None
        self._to_zero: dict[int, list[Tensor]] = {}  # grads zero_grad(set_to_none=False) asked for, by unit
        self._steps = list(steps)
        self._queue = deque(range(len(steps)))
        self._changed = threading.Condition()
        self._threads = threads
        self.finished = not steps
        # The handle's one thread, kept from step to step (a new thread's first parallel regions start OpenMP's
        # threads anew: 9 ms a step at 64M params here); the interpreter's exit waits for what it was given.
        self._done = stepper.submit(self._run) if steps else None

    def _run(self) -> None:
        if torch.get_num_threads() != self._threads:  # a new thread starts with OpenMP's default, not the caller's
            torch.set_num_threads(self._threads)
        try:
            while True:
                with self._changed:
                    if not self._queue:
                        return
                    unit = self._queue.popleft()
                    left = self.failure is not None
                    if not left:
                        self.status[unit] = Status.STEPPING
                if left:
                    self._finish(unit, Status.LEFT)
                    continue
                start = time.perf_counter()
                try:
                    adam_step_groups("CPUAdam", self._steps[unit])
                    status = Status.STEPPED
                except BaseException as error:  # collected by the next wait, on the caller's thread
                    self.failure = (unit, error)
                    status = Status.FAILED
                self.seconds[unit] = time.perf_counter() - start
                self._finish(unit, status)
        finally:
            self._steps = []
            self.finished = True

    def _finish(self, unit: int, status: Status) -> None:
        """The unit's grads zeroed where zero_grad asked for it (also while this runs), then its status."""
        while True:
            with self._changed:
                grads = self._to_zero.pop(unit, [])
                if not grads:
                    self.status[unit] = status
                    self._changed.notify_all()
                    return
            torch._foreach_zero_(grads)

    def zero_after_step(self, grads_by_unit: dict[int, list[Tensor]]) -> None:
        """Zeroes each unit's ``grads`` once the unit's step has read them: now for the units done, after its step for
        the others, before anyone waiting for the unit sees it done."""
        done: list[Tensor] = []
        with self._changed:
            for unit, grads in grads_by_unit.items():
                if self.status[unit] in (Status.QUEUED, Status.STEPPING):
                    self._to_zero.setdefault(unit, []).extend(grads)
                else:
                    done += grads
        if done:
            torch._foreach_zero_(done)

    def wait(self, unit: int) -> None:
        """Until ``unit`` is stepped (or failed, or left): first in the queue if the thread has not reached it."""
        with self._changed:
            if self.status[unit] is Status.QUEUED and self._queue[0] != unit:
                self._queue.remove(unit)
                self._queue.appendleft(unit)
            while self.status[unit] in (Status.QUEUED, Status.STEPPING):
                self._changed.wait()

    def wait_all(self) -> None:
        if self._done is not None:
            futures.wait([self._done])
