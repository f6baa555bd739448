"""One caller at a time, refused rather than waited for: the optimizers' guard against concurrent steps."""

from __future__ import annotations

__all__ = ["Turn"]


class Turn:
    """``take()`` is False while another caller holds the turn; the holder calls ``give_back()``.

    A one-token list: ``list.pop`` is atomic (one C call under the interpreter's lock, and under the
    list's own lock in free-threaded builds), and costs a fifth of a ``threading.Lock`` round trip in
    a step that releases the interpreter's lock (``benchmarks/bench_guard.py``).
    """

    def __init__(self) -> None:
        self._token = [None]

    def take(self) -> bool:
        try:
            self._token.pop()
        except IndexError:
            return False
        return True

    def give_back(self) -> None:
        self._token.append(None)

    @property
    def taken(self) -> bool:
        return not self._token
