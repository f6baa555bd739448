"""The steps whose state is not written yet: per bucket, the kernel calls that write it.

``overlap="backward"`` takes a step's weights from its previews and defers its state. Three hands
take a bucket's deferred step: its next landing (one pass commits it and previews the next step),
the worker between steps (committing ahead of the landings), and whoever must read the state now.
Each takes it under the lock, so it runs once; a commit that raises is put back, to run again.
"""

from __future__ import annotations

import threading
from typing import Any

from .stepper import run

__all__ = ["Commit", "DeferredSteps"]

Key = tuple[int, int]
Commit = list[dict[str, Any]]  # kernel calls that write the state alone


class DeferredSteps:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._commits: dict[Key, Commit] = {}

    def put(self, key: Key, commit: Commit) -> None:
        with self._lock:
            self._commits[key] = commit

    def take(self, key: Key) -> Commit:
        """Bucket ``key``'s deferred step, now the caller's to run (and to ``put`` back if it raises); [] if none."""
        with self._lock:
            return self._commits.pop(key, [])

    def run_next(self, order: list[Key]) -> bool:
        """Runs a deferred step, the first of ``order`` still deferred (else any); False where none is left."""
        with self._lock:
            key = next((k for k in order if k in self._commits), next(iter(self._commits), None))
            if key is None:
                return False
            commit = self._commits.pop(key)
        try:
            run(commit)
        except BaseException:
            self.put(key, commit)
            raise
        return True

    def run_all(self) -> None:
        while self.run_next([]):
            pass

    def __bool__(self) -> bool:
        return bool(self._commits)
