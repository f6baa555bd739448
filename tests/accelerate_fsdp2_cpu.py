"""accelerate's FSDP2 path on a process group without accelerators, for the FSDP2 framework tests.

accelerate 1.15 takes such a group for MULTI_CPU and drops the FSDP plugin (it chooses FSDP only
beside GPUs and their kin); HF Trainer inherits that. ``as_beside_gpus`` gives accelerate the
state it sets up beside GPUs, so that what follows is accelerate's own FSDP2 code (its
``fully_shard`` wrapping, optimizer swap, clipping, DCP save and load), as on a GPU machine.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import CPUOffloadPolicy


def cpu_offload_plugin(**options: Any):
    """accelerate's FSDP2 plugin with CPU offload; unpinned host memory, as pinning needs an accelerator."""
    from accelerate import FullyShardedDataParallelPlugin

    options = {**options, "fsdp_version": 2, "cpu_offload": CPUOffloadPolicy(pin_memory=False)}
    return FullyShardedDataParallelPlugin(**options)


def as_beside_gpus(accelerator, plugin) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState().distributed_type = DistributedType.FSDP  # each AcceleratorState() copies PartialState's
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
