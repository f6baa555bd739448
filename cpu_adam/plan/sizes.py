"""Sizes as people write them (``1.3B`` params, ``80GiB`` of memory), and the memory this machine has."""

from __future__ import annotations

import os
import re
from decimal import Decimal
from pathlib import Path

__all__ = ["PlanError", "detect_gpu_memory", "detect_host_memory", "format_bytes", "parse_bytes", "parse_count"]


class PlanError(ValueError):
    """Input the planner cannot use; the message names the problem and the fix."""


MAX_COUNT = 10**15
MAX_BYTES = 2**60
_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIXES = {"": 1, "B": 1}
for _i, _p in enumerate("KMGT", start=1):
    _BYTE_SUFFIXES |= {_p: 1024**_i, f"{_p}IB": 1024**_i, f"{_p}B": 1000**_i}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)"


def parse_count(text: str | int, what: str = "the parameter count") -> int:
    """``1.3B``, ``350M``, ``125k``, ``7e9``, ``2^24`` or a plain integer: a positive whole count."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise PlanError(f"{what} must be a number or a string such as '1.3B', got {text!r}")
    s = str(text).strip().replace("_", "").replace(",", "")
    power = re.fullmatch(r"2\^([0-9]{1,2})", s)
    match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]?)", s)
    if power:
        value = 2 ** int(power.group(1))
    elif match and match.group(2).upper() in _COUNT_SUFFIXES:
        value = Decimal(match.group(1)) * _COUNT_SUFFIXES[match.group(2).upper()]
    else:
        sign = "a positive" if s.startswith("-") else "a"
        raise PlanError(f"{what} must be {sign} count such as 1.3B, 350M, 2^24 or 124439808, got {text!r}")
    if not 1 <= value <= MAX_COUNT or value != int(value):
        raise PlanError(f"{what} must be a whole count from 1 to 10^15 (e.g. 1.3B, 350M), got {text!r}")
    return int(value)


def parse_bytes(text: str | int, what: str) -> int:
    """``80GiB`` (2^30), ``80GB`` (10^9), ``80G`` (GiB, as ``free -g``), ``512MiB``, or plain bytes."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise PlanError(f"{what} must be a size such as '80GiB' or a number of bytes, got {text!r}")
    s = str(text).strip().replace("_", "")
    match = re.fullmatch(_NUMBER + r"\s*([a-zA-Z]*)", s)
    if not match or match.group(2).upper() not in _BYTE_SUFFIXES:
        sign = "a positive" if s.startswith("-") else "a"
        raise PlanError(f"{what} must be {sign} size such as 80GiB, 80GB, 512MiB or a number of bytes, got {text!r}")
    value = Decimal(match.group(1)) * _BYTE_SUFFIXES[match.group(2).upper()]
    if not 1 <= value <= MAX_BYTES:
        raise PlanError(f"{what} must be from one byte to 2^60 bytes (e.g. 80GiB), got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def detect_gpu_memory() -> tuple[int, str] | None:
    """(free bytes, where they were read) of the current CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return free, f"free on cuda:{device} of {format_bytes(total)} (torch.cuda.mem_get_info)"


def detect_host_memory() -> tuple[int, str] | None:
    """(available bytes, where they were read): MemAvailable, or a smaller cgroup limit; None where neither reads."""
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024, "available (/proc/meminfo MemAvailable)"
    except OSError:
        pass
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available (os.sysconf)"
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a container's limit (cgroup v2) is not in /proc/meminfo
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max" and int(limit) - used < found[0]:
            found = int(limit) - used, "left under this container's limit (/sys/fs/cgroup/memory.max)"
    except (OSError, ValueError):
        pass
    return found
