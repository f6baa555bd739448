"""A step is all or nothing, also under Ctrl-C.

The kernel releases the GIL and cannot be interrupted; Python raises ``KeyboardInterrupt`` at
the next bytecode after it returns, which could fall between the tensors' update and the step
count's. Inside ``interrupts_deferred()`` a SIGINT is held and delivered when the block ends,
so the tensors and the counts change together or not at all. A second SIGINT inside the block
is delivered at once: a step stuck on a collective can still be interrupted.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["interrupts_deferred"]

_depth = 0  # nested blocks defer once, in the outermost


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    global _depth
    handler = signal.getsignal(signal.SIGINT)
    # Signals reach Python's handlers in the main thread only; SIG_IGN and SIG_DFL are not Python's.
    if _depth or threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    held: list[FrameType | None] = []

    def hold(signum: int, frame: FrameType | None) -> Any:
        if held:  # the second one: the user insists
            signal.signal(signal.SIGINT, handler)
            return handler(signum, frame)
        held.append(frame)
        return None

    signal.signal(signal.SIGINT, hold)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, handler)
            if held:
                handler(signal.SIGINT, held[0])
