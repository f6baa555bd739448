"""Checkpoints that survive a crash mid-save: the previous one stays whole until the new one is.

``torch.save(obj, path)`` truncates ``path`` first and writes it in place: a process killed
during the write leaves neither the old checkpoint nor a loadable new one. Here the new bytes go
to a temporary file beside ``path``, reach the disk (fsync), and only then replace ``path`` in
one rename, itself made durable by syncing the directory.
"""

from __future__ import annotations

import glob
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically: ``path`` holds the old checkpoint or the new one, whole.

    The file gets the mode ``torch.save`` would give it (the umask's), or keeps an existing one's.
    A full disk or a file size limit raises the ``OSError`` with its errno and the path. Temporary
    files that killed saves of this checkpoint left behind are removed.
    """
    path = Path(path)
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            _write(obj, f, path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        leftover.unlink(missing_ok=True)


def _write(obj: Any, f: BinaryIO, path: Path) -> None:
    try:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    except RuntimeError as error:
        # torch's writer reports a failed write as a RuntimeError, the OSError only in its context.
        cause = error.__cause__ or error.__context__
        if not isinstance(cause, OSError) or cause.errno is None:
            raise
        raise OSError(
            cause.errno,
            f"{os.strerror(cause.errno)} while saving the checkpoint (the previous one is intact)",
            str(path),
        ) from error


def _mode_for(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def load_checkpoint(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``torch.load(path, **kwargs)``; with ``weights_only=True`` by default, as torch's."""
    return torch.load(path, **kwargs)


def _sync_directory(directory: Path) -> None:
    # The rename is durable once the directory's entry is; not every platform can open one.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
