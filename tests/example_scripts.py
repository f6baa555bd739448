"""Runs a script of examples/ as a user would, for the framework tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_and_resume(name: str, out: Path, first: list[str], resumed: list[str]) -> None:
    """``examples/<name> first --out out``, then ``... resumed --out out --resume``; each must exit 0."""
    for args in (first, [*resumed, "--resume"]):
        run = subprocess.run(
            [sys.executable, str(EXAMPLES / name), *args, "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
