"""Checkpoints that survive a crash mid-save: the previous one stays whole until the new one is.

``torch.save(obj, path)`` truncates ``path`` first and writes it in place: a process killed
during the write leaves neither the old checkpoint nor a loadable new one. Here the new bytes go
to a temporary file beside ``path``, reach the disk (fsync), and only then replace ``path`` in
one rename, itself made durable by syncing the directory.

Loading checks the file first: a checkpoint is a zip archive with a CRC-32 of every record,
which ``torch.load`` does not check. ``load_checkpoint`` checks them (``_zip_check.py``: one
more read of the file, at several GB/s a thread), so a damaged, truncated or foreign file is
named as such instead of loading changed numbers or failing with an error that does not say why.
"""

from __future__ import annotations

import glob
import os
import pickle
import stat
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ._zip_check import checksums_on, first_changed_record

__all__ = ["DamagedCheckpointError", "load_checkpoint", "save_checkpoint"]


class DamagedCheckpointError(RuntimeError):
    """The file is not a whole checkpoint: empty, truncated, changed after it was saved, or not one at all."""


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
        with checksums_on():
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


def load_checkpoint(path: str | os.PathLike[str], *, verify: bool = True, **kwargs: Any) -> Any:
    """``torch.load(path, **kwargs)`` (``weights_only=True`` by default, as torch's), of a file checked first.

    Raises ``DamagedCheckpointError`` naming the file when it is empty, truncated, not a
    checkpoint, or when a record's bytes no longer match the CRC-32 written with them.
    ``verify=False`` skips the check (one more read of the file).
    """
    path = Path(path)
    if verify:
        _check_whole(path)
    try:
        return torch.load(path, **kwargs)
    except RuntimeError as error:
        # Archive metadata that Python's zip reader accepts and torch's does not: damaged all the same.
        if not str(error).startswith("PytorchStreamReader"):
            raise
        raise DamagedCheckpointError(f"{path} is damaged: torch cannot read its zip archive ({error})") from error


# The pickled magic number that opens torch's pre-1.6 format, without the protocol header.
_LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[2:-1]


# What Python's zip reader raises on damaged archive metadata (a name that is not UTF-8, an offset out of the file).
_UNREADABLE = (zipfile.BadZipFile, ValueError, EOFError, OSError, struct.error)


def _check_whole(path: Path) -> None:
    if path.stat().st_size == 0:
        raise DamagedCheckpointError(
            f"{path} is empty: not a checkpoint (a save that never finished? save_checkpoint never leaves one)"
        )
    try:
        archive = zipfile.ZipFile(path)
    except PermissionError:
        raise
    except _UNREADABLE as error:
        with path.open("rb") as f:
            head = f.read(64)
        if _LEGACY_MAGIC in head:  # torch's pre-1.6 format, without checksums, starts with it
            return
        raise DamagedCheckpointError(
            f"{path} is not a whole checkpoint: it is truncated or damaged, or not a file torch.save wrote ({error})"
        ) from error
    with archive:
        records = archive.infolist()
    if not any(r.filename.endswith("/data.pkl") or r.filename == "data.pkl" for r in records):
        raise DamagedCheckpointError(f"{path} is a zip archive but not a checkpoint: it holds no data.pkl")
    if all(r.CRC == 0 for r in records):
        return  # saved with torch's checksums turned off: nothing to check against
    try:
        bad = first_changed_record(path, records)
    except PermissionError:
        raise
    except _UNREADABLE as error:  # a record's offsets point outside the file
        raise DamagedCheckpointError(f"{path} is damaged: its zip archive cannot be read ({error})") from error
    if bad is not None:
        raise DamagedCheckpointError(
            f"{path} is damaged: the bytes of its record {bad!r} changed after the save (their CRC-32 differs from "
            "the one written with them). Load an earlier checkpoint"
        )


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
