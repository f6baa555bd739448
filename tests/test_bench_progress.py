"""The benchmarks' progress: phase lines with the time left on stderr, the tables and JSON unchanged on stdout."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from _common import Progress, clock_time, phase_time, time_left  # noqa: E402

LEFT = re.compile(r"; (\d+:)?\d+:\d\d elapsed, ~(\d+:)?\d+:\d\d left$")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress_lines(stderr: str, title: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{title} [")]


def run_benchmark(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # This checkout's cpu_adam, not whichever is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_clock_time_reads_as_a_clock() -> None:
    assert [clock_time(s) for s in (0, 7, 59.6, 754, 3723)] == ["0:00", "0:07", "1:00", "12:34", "1:02:03"]
    assert [phase_time(s) for s in (0.04, 12.34, 59.99, 61)] == ["0.0 s", "12.3 s", "1:00", "1:01"]


def test_time_left_is_the_work_left_at_the_rate_so_far() -> None:
    assert time_left(elapsed=5.0, done=0.0, total=30.0) is None
    assert time_left(elapsed=5.0, done=10.0, total=30.0) == pytest.approx(10.0)
    assert time_left(elapsed=40.0, done=30.0, total=30.0) == 0.0
    assert time_left(elapsed=40.0, done=31.0, total=30.0) == 0.0  # work over the estimate: never negative


def test_phase_lines_weigh_the_phases_by_their_work() -> None:
    clock, stream = FakeClock(), io.StringIO()
    progress = Progress(3, 40.0, "bench", stream=stream, clock=clock)
    with progress.phase("small", 10.0) as tick:
        for _ in range(10):
            clock.now += 0.5
            tick()
    clock.now += 1.0  # between phases: counts towards the rate
    with progress.phase("large", 20.0) as tick:
        clock.now += 6.0
        tick.note = "loss 1.23"
    progress.finished("elsewhere", 10.0, "ran in another process")
    assert stream.getvalue().splitlines() == [
        "bench [1/3] small: started; 0:00 elapsed, time left not known yet",
        # 10 of 40 units in 5 s: 30 units left take 15 s
        "bench [1/3] small: done in 5.0 s; 0:05 elapsed, ~0:15 left",
        "bench [2/3] large: started; 0:06 elapsed, ~0:18 left",
        # 30 of 40 units in 12 s: 10 units left take 4 s
        "bench [2/3] large: done in 6.0 s, loss 1.23; 0:12 elapsed, ~0:04 left",
        "bench [3/3] elsewhere: ran in another process; 0:12 elapsed, ~0:00 left",
    ]
    assert "\r" not in stream.getvalue()


def test_quiet_says_nothing_and_a_failed_phase_has_no_end_line() -> None:
    stream = io.StringIO()
    progress = Progress(2, 2.0, "bench", stream=stream, quiet=True)
    with progress.phase("one", 1.0) as tick:
        tick()
    progress.say("hello")
    assert stream.getvalue() == ""

    progress = Progress(1, 1.0, "bench", stream=stream, clock=FakeClock())
    with pytest.raises(RuntimeError), progress.phase("one", 1.0):
        raise RuntimeError
    assert stream.getvalue().splitlines() == ["bench [1/1] one: started; 0:00 elapsed, time left not known yet"]


def test_a_bar_only_on_a_terminal_and_only_from_the_first_step() -> None:
    pytest.importorskip("tqdm")
    for stream, wants_bar in ((io.StringIO(), False), (Terminal(), True)):
        progress = Progress(1, 4.0, "bench", stream=stream)
        assert progress.bars is wants_bar
        with progress.phase("steps", 4.0) as tick:
            before_first_step = stream.getvalue()
            for _ in range(4):
                tick()
        assert "\r" not in before_first_step  # what the first step prints (a compile) starts a line
        assert ("\r" in stream.getvalue()) is wants_bar
        assert "bench [1/1] steps: done in" in stream.getvalue()


def test_bench_replay_prints_phase_lines_on_stderr_and_its_table_on_stdout(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    config = "fp32 master / fp32 states"
    args = ("--params", "65536", "--layers", "4", "--warmup", "1", "--steps", "2", "--configs", config)
    run = run_benchmark("bench_replay.py", *args, "--json", str(out))

    lines = progress_lines(run.stderr, "bench_replay")
    runs = [f"{trajectory}, overlap {overlap}" for trajectory in ("never clips", "clips every step") for overlap in
            ("none", "backward")]  # fmt: skip
    phases = [f"{config}, serial probe", *(f"{config}, {run}" for run in runs)]
    names = [f"bench_replay [{i + 1}/5] {phase}" for i, phase in enumerate(phases)]
    assert [line.split(": ")[0] for line in lines] == [name for name in names for _ in ("start", "end")]
    assert lines[0].endswith("time left not known yet")
    assert all(LEFT.search(line) for line in lines[1:]), lines
    assert "done in" in lines[-1] and lines[-1].endswith("~0:00 left")

    stdout = run.stdout.splitlines()
    assert stdout[0] == f"0.1M params in 4 layers, {torch.get_num_threads()} threads"
    assert stdout[1].startswith("config") and stdout[1].endswith("uploads  worker  previewed")
    assert [line.startswith(config) for line in stdout[2:4]] == [True, True] and "with overlap:" in stdout[4]
    assert [line.startswith(config) for line in stdout[5:7]] == [True, True] and "with overlap:" in stdout[7]
    assert len(stdout) == 8 and "bench_replay [" not in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["trajectory"], r["overlap"]) for r in rows] == [
        (t, o) for t in ("never clips", "clips every step") for o in ("none", "backward")
    ]


def test_states_quality_in_processes_prints_a_line_as_each_run_ends(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    args = ("--quick", "--tasks", "mlp", "--rows", "fp32,8bit", "--jobs", "2", "--plot", str(tmp_path / "q.png"))
    run = run_benchmark("states_quality.py", *args, "--json", str(out))

    assert "states_quality: 2 runs in 2 processes: a line as each ends" in run.stderr
    lines = progress_lines(run.stderr, "states_quality")
    assert [line.split("] ")[0] for line in lines] == ["states_quality [1/2", "states_quality [2/2"]
    # in the order they end
    assert {line.split("] ")[1].split(": ")[0] for line in lines} == {
        "mlp CPUAdam, fp32 states seed 0",
        "mlp CPUAdam, 8-bit states seed 0",
    }
    assert all(re.search(r": final loss \d+\.\d{4}, training \d+\.\d s;", line) for line in lines), lines
    assert all(LEFT.search(line) for line in lines), lines

    assert "| task | optimizer" in run.stdout and "mlp: 8-bit states" in run.stdout
    assert "states_quality [" not in run.stdout
    result = json.loads(out.read_text())
    assert [(r["row"], r["seed"]) for r in result["runs"]] == [("fp32", 0), ("8bit", 0)]


def test_bench_gpu_offload_reports_each_probe_and_contender(tmp_path: Path) -> None:
    """Its progress path without a GPU: --allow-cpu at a tiny size (on a GPU the PCIe probe comes first)."""
    out = tmp_path / "gpu.json"
    size = ("--layers", "1", "--dim", "64", "--heads", "2", "--vocab", "256", "--seq", "32", "--batch", "2")
    steps = ("--warmup", "1", "--steps", "1", "--split-steps", "1", "--probe-numel", "65536")
    run = run_benchmark(  # cpu_adam_fp32: the old name of cpu_adam:fp32/fp32
        "bench_gpu_offload.py", "--allow-cpu", *size, *steps, "--contenders", "cpu_adam_fp32", "--json", str(out)
    )

    lines = progress_lines(run.stderr, "bench_gpu_offload")
    phases = (["PCIe probe"] if torch.cuda.is_available() else []) + [
        "CPU bandwidth probe, 65,536 elements",
        "cpu_adam:fp32/fp32 (at most 300 s)",
    ]
    assert [line.split("] ", 1)[1].split(": ")[0] for line in lines] == [
        phase for phase in phases for _ in ("start", "end")
    ]
    assert all(LEFT.search(line) for line in lines[1:]), lines
    assert re.search(r"cpu_adam:fp32/fp32 \(at most 300 s\): done in \d+\.\d s, [\d,]+ tokens/s;", lines[-1])

    assert run.stdout.startswith("device ") and "cpu_adam:fp32/fp32: {" in run.stdout
    assert "bench_gpu_offload [" not in run.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["contender"] for r in results] == ["cpu_adam:fp32/fp32"] and "error" not in results[0]
