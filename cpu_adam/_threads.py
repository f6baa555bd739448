"""How many threads a step should use, and the warning when it gets fewer."""

from __future__ import annotations

import logging
import os
import warnings

import torch

logger = logging.getLogger(__name__)

_warned = False
_judged = False  # whether the steps' thread count was judged: once per process


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cores_per_local_rank(default_local_ranks: int = 1) -> int:
    """This process's share of the cores when torchrun starts several on the machine
    (``LOCAL_WORLD_SIZE``; ``default_local_ranks`` where it is not set)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", default_local_ranks))
    return max(1, usable_cores() // max(1, local_ranks))


def warn_if_single_threaded(share: int | None = None) -> None:
    """Warns once when the step runs on 1 thread but this process's share of the cores is larger."""
    global _warned
    share = cores_per_local_rank() if share is None else share
    if not _warned and torch.get_num_threads() == 1 and share > 1:
        _warned = True
        warnings.warn(
            f"cpu_adam: the optimizer step runs on 1 thread while this process's share of the cores is {share} "
            "(torchrun sets OMP_NUM_THREADS=1). Call torch.set_num_threads("
            f"{share}) or set OMP_NUM_THREADS={share}.",
            stacklevel=3,
        )


def judge_threads_once() -> None:
    """The per-step check: the first step judges the thread count, later ones cost nothing
    (a system call on every step would be overhead on the hot path)."""
    global _judged
    if not _judged:
        _judged = True
        warn_if_single_threaded()


def check_threads(rank: int, world_size: int) -> int:
    """Logs how many threads this rank's CPU step uses; warns when torchrun's one thread wastes cores.

    The ranks on a node share its cores (``LOCAL_WORLD_SIZE``, set by torchrun; without it every
    rank is assumed to be on this node). Returns this rank's share of the cores.
    """
    share = cores_per_local_rank(default_local_ranks=world_size)
    logger.info(
        "cpu_adam.OffloadOptimizer: rank %d of %d steps on %d CPU threads (its share of the cores: %d)",
        rank,
        world_size,
        torch.get_num_threads(),
        share,
    )
    warn_if_single_threaded(share)
    return share
