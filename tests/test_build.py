"""Building and loading: first-use JIT into a fresh cache, concurrent first uses,
a stale lock, the cached load, the ahead-of-time build, and toolchain errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cpu_adam
from cpu_adam import _build

REPO = Path(__file__).resolve().parent.parent
STEP_AND_REPORT = (
    "import time, torch; t = time.perf_counter(); from cpu_adam import _build, ops; mode = _build.load(); "
    "elapsed = time.perf_counter() - t; p = torch.ones(40); "
    "ops.adam_step([p], [p.clone()], [torch.zeros(40)], [torch.zeros(40)], step=1, lr=0.1, beta1=0.9, "
    "beta2=0.999, eps=1e-8); print(mode, ops.active_isa(), p[0].item(), f'load_s={elapsed:.3f}')"
)


def python(code: str, env: dict[str, str], cwd: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return out, err


def build_dir_for(cache: Path) -> Path:
    previous = os.environ.get("CPU_ADAM_CACHE_DIR")
    os.environ["CPU_ADAM_CACHE_DIR"] = str(cache)
    try:
        return _build.build_dir()
    finally:
        if previous is None:
            del os.environ["CPU_ADAM_CACHE_DIR"]
        else:
            os.environ["CPU_ADAM_CACHE_DIR"] = previous


@pytest.mark.slow
def test_concurrent_first_uses_compile_once_then_hit_the_cache(tmp_path: Path) -> None:
    env = {"CPU_ADAM_CACHE_DIR": str(tmp_path), "CPU_ADAM_FORCE_JIT": "1"}
    # A build killed mid-way leaves torch's lock file behind; it must not hang us.
    stale = build_dir_for(tmp_path)
    stale.mkdir(parents=True)
    (stale / "lock").write_text("")
    starts = [python(STEP_AND_REPORT, env) for _ in range(3)]
    results = [finish(p) for p in starts]
    compile_lines = [line for _, err in results for line in err.splitlines() if "compiling kernels" in line]
    assert len(compile_lines) == 1, compile_lines
    assert " done in " in compile_lines[0]
    outputs = {out.split(" load_s=")[0] for out, _ in results}
    assert len(outputs) == 1 and outputs.pop().startswith("jit ")

    out, err = finish(python(STEP_AND_REPORT, env))
    assert "compiling" not in err
    assert out.startswith("jit ")


@pytest.mark.slow
def test_ahead_of_time_build_is_preferred(tmp_path: Path) -> None:
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--target", str(target), "."],
        cwd=REPO,
        env={**os.environ, "CPU_ADAM_BUILD": "1"},
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    assert list((target / "cpu_adam").glob("_C*.so"))
    process = subprocess.Popen(
        [sys.executable, "-c", STEP_AND_REPORT],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target), "CPU_ADAM_CACHE_DIR": str(tmp_path / "unused-cache")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = finish(process)
    assert out.startswith("prebuilt "), out
    assert "compiling" not in err and not (tmp_path / "unused-cache").exists()


@pytest.mark.parametrize(
    ("setup", "env", "message"),
    [
        ("", {"CXX": "no-such-compiler-c++"}, "apt-get install g++"),
        ("import torch.utils.cpp_extension as e; e.is_ninja_available = lambda: False; ", {}, "pip install ninja"),
    ],
)
def test_missing_toolchain_says_what_to_install(tmp_path: Path, setup: str, env: dict, message: str) -> None:
    code = setup + "from cpu_adam import _build; _build.load()"
    process = python(code, {"CPU_ADAM_CACHE_DIR": str(tmp_path), "CPU_ADAM_FORCE_JIT": "1", **env})
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0
    assert message in err


def test_forced_isa_from_environment() -> None:
    out, _ = finish(python(STEP_AND_REPORT, {"CPU_ADAM_ISA": "scalar"}))
    assert out.split()[1] == "scalar"
    process = python(STEP_AND_REPORT, {"CPU_ADAM_ISA": "sse9"})
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0 and "unknown ISA 'sse9'" in err and "scalar" in err


def test_info_reports_build_and_isas() -> None:
    out, _ = finish(python("from cpu_adam.info import main; main()", {}))
    assert re.search(rf"^cpu_adam +{re.escape(cpu_adam.__version__)}$", out, re.M)
    for line in ("build mode", "compiled ISAs", "supported ISAs", "active ISA", "threads in a 2^24 step", "torch"):
        assert line in out
    assert "scalar" in out


def test_import_compiles_nothing(tmp_path: Path) -> None:
    code = "import cpu_adam, cpu_adam.ops, cpu_adam.optimizer; from cpu_adam import _build; print(_build.loaded_mode())"
    out, _ = finish(python(code, {"CPU_ADAM_CACHE_DIR": str(tmp_path)}))
    assert out.strip() == "None"
    assert not any(tmp_path.iterdir())
