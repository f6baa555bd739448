"""The CRC-32s of a torch.save zip archive: made at every save, checked on demand.

torch.save writes the CRC-32 of each record into the archive (unless told not to), and
``torch.load`` never checks them. Checking reads every record once more; the records are
spread over threads, as zlib's CRC (several GB/s a core) releases the GIL.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["checksums_on", "first_changed_record"]

_PIECE = 1 << 24  # bytes read and summed at a time


@contextmanager
def checksums_on() -> Iterator[None]:
    """torch.save computes the records' CRC-32s, whatever the user's setting."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.5 always computes them
        yield
        return
    before = config.save.compute_crc32
    config.save.compute_crc32 = True
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def first_changed_record(path: Path, records: list[zipfile.ZipInfo]) -> str | None:
    """The name of a record of ``path`` whose bytes no longer match their CRC-32, or None."""
    fd = os.open(path, os.O_RDONLY)
    try:
        threads = max(1, min(torch.get_num_threads(), len(records)))
        largest_first = sorted(records, key=lambda r: r.compress_size, reverse=True)
        with ThreadPoolExecutor(threads) as pool:
            sums = pool.map(lambda r: (r, _crc(fd, r)), largest_first)
            return next((r.filename for r, crc in sums if crc != r.CRC), None)
    finally:
        os.close(fd)


def _crc(fd: int, record: zipfile.ZipInfo) -> int:
    if record.compress_type != zipfile.ZIP_STORED:  # torch.save stores every record as it is
        return ~record.CRC & 0xFFFFFFFF
    header = os.pread(fd, 30, record.header_offset)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        return ~record.CRC & 0xFFFFFFFF
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    if os.pread(fd, name_len, record.header_offset + 30) != record.filename.encode():
        return ~record.CRC & 0xFFFFFFFF  # the record's own header names another
    at, left, crc = record.header_offset + 30 + name_len + extra_len, record.compress_size, 0
    while left:
        piece = os.pread(fd, min(left, _PIECE), at)
        if not piece:
            return ~record.CRC & 0xFFFFFFFF  # the file ends inside the record
        crc, at, left = zlib.crc32(piece, crc), at + len(piece), left - len(piece)
    return crc
