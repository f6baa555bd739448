"""``python -m cpu_adam.info``: what was built, what this CPU supports, what runs."""

from __future__ import annotations

import os
import platform

import torch

from . import __version__, _build, ops


def collect() -> dict[str, object]:
    mode = _build.load()
    return {
        "cpu_adam": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "build mode": mode,
        "kernel cache": str(_build.build_dir()) if mode == "jit" else "(prebuilt cpu_adam._C)",
        "compiled ISAs": ", ".join(ops.compiled_isas()),
        "supported ISAs": ", ".join(ops.supported_isas()),
        "active ISA": ops.active_isa() + (" (forced by CPU_ADAM_ISA)" if os.environ.get("CPU_ADAM_ISA") else ""),
        "threads": f"{torch.get_num_threads()} of {os.cpu_count()} cores",
        "threads in a 2^24 step": ops.threads_for(1 << 24),
    }


def main() -> None:
    info = collect()
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
