"""Shared helpers for the benchmarks: sizes, interleaved timing, medians, tables, peers.

The 2-core machines these run on change memory bandwidth from minute to minute, so a time
measured alone says little. Every comparison here runs its contenders interleaved in one
process (one step of each per round, many rounds) and quotes medians of per-round ratios.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Step = Callable[[], None]


def parse_size(text: str) -> int:
    """'26', '2^26', '1<<26' are log2 sizes; '67108864', '64M', '1e6' are counts."""
    text = text.strip().replace("_", "")
    match = re.fullmatch(r"(?:2\^|2\*\*|1<<)?(\d+)", text)
    if match and (text != match.group(1) or int(text) <= 40):
        return 1 << int(match.group(1))
    suffixes = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    if text[-1:].lower() in suffixes:
        return int(float(text[:-1]) * suffixes[text[-1].lower()])
    return int(float(text))


def size_label(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"{n:,}"


def parse_threads(text: str | None) -> list[int]:
    """None: torch's current count; 'sweep': 1..nproc; otherwise a comma list."""
    if text is None:
        return [torch.get_num_threads()]
    if text == "sweep":
        return list(range(1, (os.cpu_count() or 1) + 1))
    return [int(t) for t in text.split(",")]


@dataclass
class Contender:
    """One implementation in an interleaved comparison: a step and the bytes it must move."""

    name: str
    step: Step
    bytes_moved: int
    times: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)


def interleave(contenders: Sequence[Contender], rounds: int, warmup: int, tick: Callable[[], None]) -> None:
    """Runs one step of each contender per round, recording wall times after the warmup.

    The order rotates each round so no contender always follows the same neighbour (whose
    leftovers in cache, or whose write-backs still draining, would favour or slow it).
    """
    for r in range(warmup + rounds):
        shift = r % len(contenders)
        for c in list(contenders[shift:]) + list(contenders[:shift]):
            start = time.perf_counter()
            c.step()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                c.times.append(elapsed)
        tick()


def ratio(numerator: Contender, denominator: Contender) -> float:
    """Median over rounds of numerator time / denominator time (same-round pairs only)."""
    return statistics.median(a / b for a, b in zip(numerator.times, denominator.times))


def spread(c: Contender) -> float:
    """Interquartile range of the step times relative to their median: the noise of a row."""
    q = statistics.quantiles(c.times, n=4)
    return (q[2] - q[0]) / c.median_s


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-markdown table, padded so it also reads as plain text."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def progress(total: int, desc: str):
    """A tqdm bar when tqdm is installed (the [bench] extra), otherwise a no-op with the same calls."""
    try:
        from tqdm import tqdm
    except ImportError:

        class _Silent:
            def update(self, n: int = 1) -> None:
                pass

            def set_description(self, text: str) -> None:
                pass

            def close(self) -> None:
                pass

        return _Silent()
    return tqdm(total=total, desc=desc, unit="round", leave=False, dynamic_ncols=True)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for row in out.splitlines():
            if row.startswith("Model name:"):
                return row.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, object]:
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def deepspeed_adam() -> tuple[type | None, str]:
    """DeepSpeedCPUAdam and its version, or None and why it cannot be used."""
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or deepspeed failing its own import-time checks
        return None, f"not installed ({type(exc).__name__})"
    return DeepSpeedCPUAdam, f"deepspeed {deepspeed.__version__}"


def load_deepspeed_op(cls: type) -> tuple[bool, str]:
    """Builds (first time, about a minute) or loads DeepSpeed's cpu_adam op by making one optimizer."""
    start = time.perf_counter()
    try:
        cls([torch.nn.Parameter(torch.zeros(8))])
    except Exception as exc:  # a failed JIT build surfaces as many exception types
        return False, f"build failed: {type(exc).__name__}: {exc}"[:200]
    return True, f"op loaded in {time.perf_counter() - start:.1f} s"
