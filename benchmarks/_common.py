"""Shared helpers for the benchmarks: sizes, interleaved timing, medians, tables, progress, peers.

The 2-core machines these run on change memory bandwidth from minute to minute, so a time
measured alone says little. Every comparison here runs its contenders interleaved in one
process (one step of each per round, many rounds) and quotes medians of per-round ratios.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

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


def clock_time(seconds: float) -> str:
    """A duration as a clock shows it: '0:07', '12:34', '1:02:03'."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def phase_time(seconds: float) -> str:
    """How long a phase took: tenths of a second under a minute, a clock's time above."""
    return f"{seconds:.1f} s" if seconds < 59.95 else clock_time(seconds)


def time_left(elapsed: float, done: float, total: float) -> float | None:
    """Seconds until `total` units of work are done at the rate of the `done` units so far (None before any)."""
    if done <= 0:
        return None
    return elapsed * max(total - done, 0.0) / done


class Progress:
    """Where a long run stands, on stderr (stdout stays the tables and JSON the scripts print).

    The run is a number of phases, each with an amount of work in units the caller picks so that a
    unit costs about the same in every phase (steps, rounds, or steps weighted by a known cost). A
    line marks each phase's start and end with the time elapsed and the time left for the whole
    run, at the rate of the work done so far. Within a phase, on a terminal with tqdm installed (the
    [bench] extra), a bar counts the phase's steps; elsewhere (a CI log, a file) only the lines come.
    """

    def __init__(
        self,
        phases: int,
        work: float,
        title: str = "",
        *,
        quiet: bool = False,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
        bars: bool | None = None,
    ) -> None:
        self.phases, self.total, self.title = phases, work, title
        self.quiet = quiet
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock
        self.began = clock()
        self.done = 0.0
        self.started = 0
        if bars is None:
            bars = _has_tqdm() and getattr(self.stream, "isatty", lambda: False)()
        self.bars = bars and not quiet

    def elapsed(self) -> float:
        return self.clock() - self.began

    def time_left(self, done: float | None = None) -> float | None:
        return time_left(self.elapsed(), self.done if done is None else done, self.total)

    def _line(self, index: int, name: str, what: str) -> None:
        if self.quiet:
            return
        left = self.time_left()
        estimate = "time left not known yet" if left is None else f"~{clock_time(left)} left"
        prefix = f"{self.title} " if self.title else ""
        print(
            f"{prefix}[{index}/{self.phases}] {name}: {what}; {clock_time(self.elapsed())} elapsed, {estimate}",
            file=self.stream,
            flush=True,
        )

    @contextmanager
    def phase(self, name: str, work: float, steps: int | None = None, unit: str = "step") -> Iterator[Phase]:
        """A phase of `work` units; call what it yields once per step (`steps` of them, default `work`)."""
        self.started += 1
        index = self.started
        self._line(index, name, "started")
        current = Phase(self, name, work, round(work) if steps is None else steps, unit)
        try:
            yield current
        finally:
            current.close()
        self.done += work
        note = f", {current.note}" if current.note else ""
        self._line(index, name, f"done in {phase_time(self.clock() - current.began)}{note}")

    def say(self, text: str) -> None:
        """A line of its own: what is about to happen where no phase line would say it."""
        if not self.quiet:
            print(f"{self.title}: {text}" if self.title else text, file=self.stream, flush=True)

    def finished(self, name: str, work: float, note: str = "") -> None:
        """A phase that ran elsewhere (another process) and ended now: its end line only."""
        self.started += 1
        self.done += work
        self._line(self.started, name, note or "done")


class Phase:
    """One phase of a Progress: called once per step, it moves the phase's bar (where there is one)."""

    def __init__(self, progress: Progress, name: str, work: float, steps: int, unit: str) -> None:
        self.progress, self.name, self.work, self.steps, self.unit = progress, name, work, steps, unit
        self.began = progress.clock()
        self.ticks = 0
        self.note = ""  # appended to the phase's end line: a result worth seeing as it comes
        self._bar: Any = None

    def __call__(self, n: int = 1) -> None:
        self.ticks += n
        if not self.progress.bars:
            return
        if self._bar is None:
            # Made at the first step, not at the start: what the first step prints (the kernels'
            # first-use compile) then gets lines of its own instead of landing inside the bar.
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.steps,
                desc=self.name,
                unit=self.unit,
                leave=False,
                dynamic_ncols=True,
                file=self.progress.stream,
            )
        partial = self.work * min(1.0, self.ticks / max(1, self.steps))
        left = self.progress.time_left(self.progress.done + partial)
        if left is not None:
            self._bar.set_postfix_str(f"run ~{clock_time(left)} left", refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _has_tqdm() -> bool:
    return importlib.util.find_spec("tqdm") is not None


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


@contextmanager
def peers_quiet() -> Iterator[None]:
    """The peers' chatter held back (import-time notices of optional libraries they could not load, deprecation
    warnings, DeepSpeed's accelerator notice), printed through logging and warnings; ours goes through print."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def deepspeed_adam() -> tuple[type | None, str]:
    """DeepSpeedCPUAdam and its version, or None and why it cannot be used."""
    try:
        with peers_quiet():
            import deepspeed
            from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # ImportError, or deepspeed failing its own import-time checks
        return None, f"not installed ({type(exc).__name__})"
    return DeepSpeedCPUAdam, f"deepspeed {deepspeed.__version__}"


def load_deepspeed_op(cls: type) -> tuple[bool, str, dict[str, object] | None]:
    """Builds (first time, about a minute) or loads DeepSpeed's cpu_adam op by making one optimizer.

    Returns whether it loaded, a line saying how long it took, and how the op was built (deepspeed_build).
    """
    start = time.perf_counter()
    try:
        with peers_quiet():
            opt = cls([torch.nn.Parameter(torch.zeros(8))])
    except Exception as exc:  # a failed JIT build surfaces as many exception types
        return False, f"build failed: {type(exc).__name__}: {exc}"[:200], None
    return True, f"op loaded in {time.perf_counter() - start:.1f} s", deepspeed_build(opt.ds_opt_adam)


# DeepSpeed's op builder picks its Adam kernel's vectors with one of these macros (simd_width() in
# op_builder/builder.py): __AVX512__ where the CPU has AVX-512F, else __AVX256__ where it has AVX2.
# Its AVX2 kernel has no bf16 path: bf16 params or states step in its scalar loop.
DEEPSPEED_SIMD = {
    "__AVX512__": "AVX-512 (16 fp32 lanes, bf16 vectorized)",
    "__AVX256__": "AVX2 (8 fp32 lanes; bf16 in its scalar loop)",
    "__SVE__": "SVE",
    "__NEON__": "NEON (4 fp32 lanes)",
    "__SCALAR__": "scalar",
}


def deepspeed_build(op: Any) -> dict[str, object]:
    """How a loaded DeepSpeed op module was compiled: -march, the SIMD macro, and the ISA they give.

    A JIT-built op's flags are read from the build.ninja beside it (what ninja ran); an op installed
    prebuilt (DS_BUILD_CPU_ADAM=1 at install) carries no record of them, and says so.
    """
    import deepspeed

    so = Path(getattr(op, "__file__", "") or "")
    ninja = so.parent / "build.ninja"
    info: dict[str, object] = {"deepspeed": deepspeed.__version__, "op": so.name}
    if not ninja.is_file():
        return info | {"built": "prebuilt", "flags": [], "isa": "unknown (prebuilt op, flags not recorded)"}
    cflags = next(
        (row.split("=", 1)[1].split() for row in ninja.read_text().splitlines() if row.startswith("cflags")), []
    )
    flags = [f for f in cflags if f.startswith(("-march", "-mcpu", "-mno-")) or f[2:] in DEEPSPEED_SIMD]
    simd = next((f[2:] for f in flags if f[2:] in DEEPSPEED_SIMD), "__SCALAR__")
    return info | {"built": "JIT", "flags": flags, "isa": DEEPSPEED_SIMD[simd]}


def describe_deepspeed_build(build: dict[str, object]) -> str:
    """'deepspeed 0.19.8, op JIT-built with -march=native -D__AVX512__: AVX-512 (...)'."""
    flags = " ".join(map(str, build["flags"]))
    how = f"JIT-built with {flags}" if build["built"] == "JIT" else "prebuilt"
    return f"deepspeed {build['deepspeed']}, op {build['op']} {how}: {build['isa']}"


def deepspeed_adam_avx2(cls: type) -> type:
    """DeepSpeedCPUAdam on an op built as DeepSpeed builds it on an x86 CPU without AVX-512.

    Its own builder, named cpu_adam_avx2 so it JIT-builds beside the native op and loads in the
    same process: DeepSpeed's flags (-march=native ... -D__AVX256__, the macro its simd_width()
    gives where AVX-512F is missing) with -mno-avx512f after them, so the compiler emits no
    AVX-512 either. DeepSpeed has no setting for this; the builder is swapped in while the
    optimizer is made (DeepSpeedCPUAdam loads its op in __init__ and keeps it).
    """
    import deepspeed.ops.adam.cpu_adam as ds_module

    native = ds_module.CPUAdamBuilder

    class AVX2Builder(native):  # type: ignore[misc, valid-type]
        NAME = "cpu_adam_avx2"

        def simd_width(self) -> str:
            return "-D__AVX256__"

        def cxx_args(self) -> list[str]:
            return [*super().cxx_args(), "-mno-avx512f"]

    class DeepSpeedCPUAdamAVX2(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            ds_module.CPUAdamBuilder = AVX2Builder
            try:
                super().__init__(*args, **kwargs)
            finally:
                ds_module.CPUAdamBuilder = native

    return DeepSpeedCPUAdamAVX2
