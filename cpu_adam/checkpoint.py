"""Checkpoints that survive a crash mid-save: the previous one stays whole until the new one is.

``torch.save(obj, path)`` truncates ``path`` first and writes it in place: a process killed
during the write leaves neither the old checkpoint nor a loadable new one. Here the new bytes go
to a temporary file beside ``path``, reach the disk (fsync), and only then replace ``path`` in
one rename, itself made durable by syncing the directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically: ``path`` holds the old checkpoint or the new one, whole."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)


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
