"""One thread that runs jobs in order and, when it has none, idle work: the kernel calls of overlap="backward".

Its kernels run on their own intra-op threads, one fewer than the process's by default, so that
the thread running the model (autograd, the grad hooks, the launches of GPU work) keeps a core:
on 2 cores, a worker on both slowed the hooks' copies and the uploads by 2-3x.

A job's ticket says when it has run (``wait``). Idle work is done a unit at a time between jobs,
so a job waits for at most one unit. The first exception is raised by the next ``wait``. Jobs
still run after it (each must leave its own work whole or undone), but idle work stops until the
next ``wake``, so what failed is not retried behind the caller's back.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable

import torch

from .._threads import judge_threads_once
from ..ops import threads_for

__all__ = ["Worker"]


class Worker:
    def __init__(self, idle: Callable[[], bool], threads: int) -> None:
        """``idle`` does one unit of idle work and returns whether more is left; the jobs' kernels run on
        ``threads`` intra-op threads."""
        self._idle = idle
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._submitted = 0
        self._done = 0
        self._idle_wanted = False  # since the last wake, not stopped by a wait or an error
        self._idle_left = False  # the last unit said more is left
        self._busy_idle = False
        self._error: BaseException | None = None
        self._stopping = False
        judge_threads_once()  # the process's thread count, here: the worker's is one fewer by design
        threads_for(1)  # the kernel is built and loaded here, where a failure is raised to the caller
        ready = threading.Event()
        mine = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, args=(threads, ready), name="cpu_adam-overlap", daemon=True)
        self._thread.start()
        ready.wait()
        # torch.set_num_threads also sets the process's defaults (new threads', MKL's): this thread's go back.
        torch.set_num_threads(mine)

    def submit(self, job: Callable[[], None]) -> int:
        """Queues ``job``; returns its ticket for ``wait``."""
        with self._cond:
            self._jobs.append(job)
            self._submitted += 1
            self._cond.notify_all()
            return self._submitted

    def wake(self) -> None:
        """There is idle work again."""
        with self._cond:
            self._idle_wanted = self._idle_left = True
            self._cond.notify_all()

    def wait(self, ticket: int | None = None, *, idle: bool = False) -> None:
        """Returns once job ``ticket`` (every job so far where None) has run; with ``idle``, the idle unit in
        progress too, and none starts until the next ``wake``. Raises the first error of any job or idle unit."""
        with self._cond:
            upto = self._submitted if ticket is None else ticket
            if idle:
                self._idle_wanted = False
            while not self._error and (self._done < upto or (idle and self._busy_idle)):
                if sys.is_finalizing():  # the thread is frozen: nothing will read the state
                    return
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"cpu_adam.OffloadOptimizer: the overlapped step failed: {error}") from error

    def _loop(self, threads: int, ready: threading.Event) -> None:
        try:
            torch.set_num_threads(threads)
            # Each library sets a thread's count from the process's default at its first parallel call in
            # that thread (torch's and the kernel's each keep their own flag): both make it now, while that
            # is ours.
            torch.get_num_threads()
            threads_for(1)
        except BaseException as error:  # raised by the first wait; the jobs still run
            self._error = error
        finally:
            ready.set()
        while True:
            with self._cond:
                while not (self._jobs or self._stopping or self._idle_due()):
                    self._cond.wait()
                if self._jobs:
                    job, is_job = self._jobs.popleft(), True
                elif self._stopping:
                    return
                else:
                    job, is_job, self._busy_idle = self._idle, False, True
            more = False
            try:
                more = bool(job()) and not is_job
            except BaseException as error:
                with self._cond:
                    self._error = self._error or error
                    self._idle_wanted = False
            with self._cond:
                if is_job:
                    self._done += 1
                else:
                    self._busy_idle = False
                    self._idle_left = more
                self._cond.notify_all()

    def _idle_due(self) -> bool:
        return self._idle_wanted and self._idle_left and self._error is None

    def stop(self) -> None:
        """Runs the jobs queued, then ends the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
