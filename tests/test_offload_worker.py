"""The overlap's worker thread: jobs in order with tickets, idle work between them, errors raised once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cpu_adam.offload.worker import Worker


class Idle:
    """Idle work of ``units`` units, each recorded; ``fail_at`` raises instead."""

    def __init__(self, units: int = 0, fail_at: int | None = None) -> None:
        self.left, self.done, self.fail_at = units, [], fail_at
        self.release = threading.Event()
        self.release.set()

    def __call__(self) -> bool:
        self.release.wait()
        if self.left == 0:
            return False
        if len(self.done) == self.fail_at:
            self.fail_at = None
            raise RuntimeError("idle unit failed")
        self.done.append(time.monotonic())
        self.left -= 1
        return self.left > 0


def _until(done, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_jobs_run_in_order_and_a_ticket_waits_for_its_own():
    worker = Worker(Idle(), 1)
    order, gate = [], threading.Event()
    first = worker.submit(lambda: order.append(1))
    second = worker.submit(lambda: (gate.wait(), order.append(2)))
    worker.wait(first)
    assert order == [1], "the second job has not run: its ticket was not waited for"
    gate.set()
    worker.wait(second)
    assert order == [1, 2]
    worker.stop()


def test_an_error_is_raised_once_and_later_jobs_still_run():
    worker = Worker(Idle(), 1)
    ran = []
    worker.submit(lambda: (_ for _ in ()).throw(ValueError("job failed")))
    later = worker.submit(lambda: ran.append("later"))
    with pytest.raises(RuntimeError, match="overlapped step failed: job failed"):
        worker.wait(later)
    assert ran == ["later"]
    worker.wait()  # raised once
    worker.stop()


def test_idle_work_runs_when_woken_until_done():
    idle = Idle(units=5)
    worker = Worker(idle, 1)
    worker.wake()
    _until(lambda: not idle.left)
    assert len(idle.done) == 5
    worker.stop()


def test_waiting_for_the_idle_work_waits_for_the_unit_running_and_starts_no_more():
    idle = Idle(units=3)
    idle.release.clear()
    worker = Worker(idle, 1)
    worker.wake()
    time.sleep(0.05)  # the worker is inside a unit, held
    threading.Timer(0.1, idle.release.set).start()
    worker.wait(idle=True)
    assert len(idle.done) == 1, "the unit running finished; no other started"
    time.sleep(0.05)
    assert len(idle.done) == 1
    worker.stop()


def test_a_failed_idle_unit_is_not_retried_until_woken():
    idle = Idle(units=3, fail_at=1)
    worker = Worker(idle, 1)
    worker.wake()
    with pytest.raises(RuntimeError, match="idle unit failed"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            worker.wait(idle=True)
            worker.wake()
    time.sleep(0.05)
    assert len(idle.done) == 1, "not retried behind the caller's back"
    worker.wake()
    _until(lambda: not idle.left)
    assert len(idle.done) == 3
    worker.stop()


def test_the_jobs_run_on_their_own_thread_count_and_the_callers_is_kept():
    threads = torch.get_num_threads()
    worker = Worker(Idle(), 1)
    seen = []
    worker.wait(worker.submit(lambda: seen.append(torch.get_num_threads())))
    assert seen == [1] and torch.get_num_threads() == threads
    worker.stop()


def test_stop_runs_the_jobs_queued():
    worker = Worker(Idle(), 1)
    ran = []
    gate = threading.Event()
    worker.submit(gate.wait)
    worker.submit(lambda: ran.append(1))
    threading.Timer(0.05, gate.set).start()
    worker.stop()
    assert ran == [1]


def test_a_wake_while_an_idle_error_is_pending_starts_no_unit_until_the_error_was_raised():
    idle = Idle(units=4, fail_at=1)
    worker = Worker(idle, 1)
    worker.wake()
    _until(lambda: idle.fail_at is None)  # unit 0 ran, unit 1 raised
    worker.wake()  # before any wait: the error is still pending
    time.sleep(0.1)
    assert len(idle.done) == 1, "an idle unit ran while its predecessor's error was pending"
    with pytest.raises(RuntimeError, match="idle unit failed"):
        worker.wait(idle=True)
    worker.wait(idle=True)  # raised once
    worker.wake()
    _until(lambda: not idle.left)
    assert len(idle.done) == 4
    worker.stop()
