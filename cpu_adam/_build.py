"""The one description of the extension's sources and flags, and its loader.

Two ways to get the compiled kernels, tried in this order:
- prebuilt: ``cpu_adam._C``, compiled at install with ``CPU_ADAM_BUILD=1``;
- JIT: compiled on first use with ninja into a cache keyed by torch version,
  Python version and a hash of the sources and flags.

This module imports neither torch nor the package at top level: ``setup.py``
loads it by path to describe the ahead-of-time build.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LIBRARY_NAME = "cpu_adam_kernels"
SOURCES = (
    "ops.cpp",
    "checks.cpp",
    "dispatch.cpp",
    "cpu_features.cpp",
    "memory_overlap.cpp",
    "norms.cpp",
    "kernels/scalar.cpp",
    "kernels/avx2.cpp",
    "kernels/avx512.cpp",
    "kernels/avx512_bf16.cpp",
    "kernels/neon.cpp",
    "kernels/neon_bf16.cpp",
    "kernels/sve.cpp",
    "kernels/sve_bf16.cpp",
)
# No -march=native: ISA code is enabled per file by target pragmas and chosen at
# run time (files for the other architecture compile to nothing). -ffp-contract=off
# keeps every ISA bitwise equal to the scalar kernel.
# -fopenmp: at::parallel_for is inlined from torch's headers and runs serially
# unless OpenMP is on; torch ships libgomp.so.1, so the same runtime is shared.
CXX_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)

_loaded_mode: str | None = None


def source_dir() -> Path:
    """csrc/ shipped inside the package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise RuntimeError(f"cpu_adam: kernel sources not found next to {here}; reinstall the package")


def source_paths(root: Path | None = None) -> list[Path]:
    root = root or source_dir()
    return [root / s for s in SOURCES]


def cache_root() -> Path:
    override = os.environ.get("CPU_ADAM_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "cpu_adam"


def build_dir() -> Path:
    import torch

    digest = hashlib.sha256()
    digest.update(" ".join(CXX_FLAGS + LINK_FLAGS).encode())
    root = source_dir()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".cpp", ".h"):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / f"torch{torch.__version__}-{py}-{digest.hexdigest()[:16]}"


def loaded_mode() -> str | None:
    """'prebuilt', 'jit', or None before the first load."""
    return _loaded_mode


def load() -> str:
    """Registers torch.ops.cpu_adam.* once per process; returns the build mode."""
    global _loaded_mode
    if _loaded_mode is None:
        if os.environ.get("CPU_ADAM_FORCE_JIT") != "1" and _import_prebuilt():
            _loaded_mode = "prebuilt"
        else:
            _load_jit()
            _loaded_mode = "jit"
    return _loaded_mode


def _import_prebuilt() -> bool:
    try:
        import cpu_adam._C  # noqa: F401
    except ImportError:
        return False
    return True


def _library_file(directory: Path) -> Path:
    return directory / f"{LIBRARY_NAME}.so"


def _load_jit() -> None:
    import torch

    directory = build_dir()
    ready = directory / "ready"
    if not ready.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory / "build.flock"):
            if not ready.exists():
                _compile(directory)
                ready.touch()
    torch.ops.load_library(str(_library_file(directory)))


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel when its holder dies, so a killed build
    # never leaves a lock that hangs the next one.
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_toolchain() -> None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"cpu_adam compiles its kernels on first use and needs a C++ compiler, but '{compiler}' "
            "was not found. Install one (Debian/Ubuntu: apt-get install g++; Fedora: dnf install "
            "gcc-c++; conda: conda install -c conda-forge gxx) or point CXX at it."
        )
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise RuntimeError(
            "cpu_adam compiles its kernels on first use with ninja, which was not found. "
            "Install it with `pip install ninja` (or apt-get install ninja-build)."
        )


def _compile(directory: Path) -> None:
    from torch.utils.cpp_extension import load

    _check_toolchain()
    # torch's own build lock: a file left behind by a killed build would make
    # torch wait forever. Holding our flock, nobody else is building here.
    (directory / "lock").unlink(missing_ok=True)
    print(f"cpu_adam: compiling kernels into {directory} (first use only) ...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    load(
        name=LIBRARY_NAME,
        sources=[str(p) for p in source_paths()],
        extra_cflags=list(CXX_FLAGS),
        extra_ldflags=list(LINK_FLAGS),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    print(f" done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
