"""One caller at a time, refused rather than waited for: the optimizers' guard against concurrent steps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["Turn", "one_at_a_time"]

Method = TypeVar("Method", bound=Callable[..., Any])


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


def one_at_a_time(refusal: Callable[[str], Exception]) -> Callable[[Method], Method]:
    """A method that runs only while no other caller is in one of its object's ``one_at_a_time`` methods (they
    share the object's ``_turn``); else it raises ``refusal(its name)`` before it runs. Inside a compiled region it
    runs as it is: a compiled step is one opaque op, guarded where it is called."""

    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return method(self, *args, **kwargs)
            turn = self._turn
            if not turn.take():
                raise refusal(method.__name__)
            try:
                return method(self, *args, **kwargs)
            finally:
                turn.give_back()

        return cast(Method, guarded)

    return decorate
