"""Runs a function on N local processes joined by a gloo process group, for the dist tests.

Every way a rank can go wrong fails the calling test instead of hanging it: an exception in
any rank is re-raised here with its traceback, collectives time out, and the whole run has a
deadline after which the ranks are killed.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS), so gloo never binds
    a routable address."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return names[0] if names else "lo"


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int, fn: Callable[..., None], world_size: int, store_path: str, port: int, timeout_s: float, args: tuple
) -> None:
    faulthandler.enable()  # a rank killed by a signal still prints where it was
    # Environment first: engines such as DeepSpeed read these instead of the live process group.
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": loopback_interface(),
        }
    )
    # The ranks share the machine's cores; more threads than cores would only make them wait.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # The rank's work is done and checked. Skip interpreter teardown: DeepSpeed leaves process
    # groups and threads of its own behind, and tearing the process down with them alive
    # aborted ("terminate called without an active exception") in about 1 run in 10.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], *args: Any, world_size: int = 2, timeout_s: float = 90.0) -> None:
    """Calls ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    ``fn`` must be importable by name (a module-level function of a test module).
    """
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        # Collectives time out a little before the run's deadline, so a stuck rank usually
        # reports what it was waiting for rather than just being killed.
        spawn_args = (fn, world_size, store_path, free_loopback_port(), timeout_s * 0.8, args)
        context = mp.start_processes(_rank_main, args=spawn_args, nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            # join() raises as soon as one rank fails (and terminates the others).
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout_s:.0f} s; killed")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
