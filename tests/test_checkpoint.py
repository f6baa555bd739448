"""Atomic checkpoints: a save killed at any moment leaves the last complete checkpoint loadable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cpu_adam import load_checkpoint, save_checkpoint

# A child that saves numbered checkpoints of about 40 MB back to back, forever.
_SAVER = textwrap.dedent(
    """
    import sys, torch
    from cpu_adam import save_checkpoint
    path = sys.argv[1]
    blob = torch.arange(10_000_000, dtype=torch.float32)
    n = 0
    while True:
        n += 1
        save_checkpoint({"n": n, "blob": blob + n}, path)
        print(n, flush=True)
    """
)


def test_round_trip(tmp_path: Path):
    state = {"step": 3, "weights": torch.randn(5)}
    save_checkpoint(state, tmp_path / "ckpt.pt")
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    assert loaded["step"] == 3 and torch.equal(loaded["weights"], state["weights"])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"], "no temporary file left behind"


def test_a_failed_save_keeps_the_old_checkpoint(tmp_path: Path):
    save_checkpoint({"n": 1}, tmp_path / "ckpt.pt")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot be saved")

    with pytest.raises(RuntimeError, match="cannot be saved"):
        save_checkpoint({"n": 2, "bad": Unpicklable()}, tmp_path / "ckpt.pt")
    assert load_checkpoint(tmp_path / "ckpt.pt") == {"n": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.mark.slow
def test_kill_9_during_saves_always_leaves_the_last_complete_checkpoint(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    rng = random.Random(0)
    for trial in range(4):
        child = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(path)], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
        )
        done = int(child.stdout.readline())  # at least one save completed
        time.sleep(rng.uniform(0.0, 0.3))  # then die somewhere in a later one
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        done = max([done, *map(int, out.split())])
        loaded = load_checkpoint(path)
        assert loaded["n"] >= done, f"trial {trial}: checkpoint {loaded['n']} older than the last completed {done}"
        assert torch.equal(loaded["blob"], torch.arange(10_000_000, dtype=torch.float32) + loaded["n"])


def test_modes_are_torch_saves_or_the_replaced_files(tmp_path: Path):
    umask = os.umask(0o022)
    try:
        save_checkpoint({"n": 1}, tmp_path / "new.pt")
        torch.save({"n": 1}, tmp_path / "by_torch.pt")
        assert (tmp_path / "new.pt").stat().st_mode == (tmp_path / "by_torch.pt").stat().st_mode
        os.chmod(tmp_path / "new.pt", 0o640)
        save_checkpoint({"n": 2}, tmp_path / "new.pt")
        assert (tmp_path / "new.pt").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)


def test_temporary_files_of_killed_saves_are_removed_by_the_next_save(tmp_path: Path):
    for leftover in (".ckpt.pt.k1lled.tmp", ".ckpt.pt.0ther.tmp"):
        (tmp_path / leftover).write_bytes(b"partial")
    (tmp_path / ".other.pt.keep.tmp").write_bytes(b"another checkpoint's")
    save_checkpoint({"n": 1}, tmp_path / "ckpt.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.keep.tmp", "ckpt.pt"]


_FILE_SIZE_LIMIT = textwrap.dedent(
    """
    import errno, resource, signal, sys, torch
    from cpu_adam import save_checkpoint
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
    try:
        save_checkpoint({"blob": torch.zeros(1_000_000)}, sys.argv[1])
    except OSError as error:
        print(error.errno == errno.EFBIG, error.filename == sys.argv[1], "intact" in str(error))
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file size limits")
def test_a_file_size_limit_raises_an_os_error_naming_the_path(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"n": 1}, path)
    run = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMIT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.stdout.split() == ["True", "True", "True"], run.stdout + run.stderr[-2000:]
    assert load_checkpoint(path) == {"n": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
