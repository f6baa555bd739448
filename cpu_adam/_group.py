"""One param group of the offload optimizer: its params and the host storage of this rank's shard.

Params keep their own device storage; the flat layout (``_flat.py``: buckets, ZeRO pieces)
exists on the host only: masters, moments (8-bit ones with their block scales), the pinned bf16
buffer that receives the grads and then the updated weights, the fp32 accumulator of multi-flush
buckets, and per param whether it got a grad in this window and how many steps it has taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._device import DeviceOps, Event
from ._flat import FlatLayout, canonical_offsets
from ._pinned import HostBuffer
from .quant8 import BLOCK

__all__ = ["BucketState", "GroupBuffers"]


@dataclass
class BucketState:
    staging: Tensor | None = None  # grads being packed since the bucket was last flushed
    packed: set[int] = field(default_factory=set)  # params packed into the open staging area
    flushes: int = 0  # contributions sent down in this window
    event: Event = None  # completion of its last copy down


class GroupBuffers:
    """One param group: its params (each with its own device storage) and the host buffers of this shard."""

    def __init__(
        self,
        params: list[Tensor],
        dev: DeviceOps,
        bucket_size: int,
        master_dtype: torch.dtype,
        state_dtype: torch.dtype,
        *,
        world_size: int = 1,
        rank: int = 0,
    ) -> None:
        self.params = params
        self.layout = layout = FlatLayout([p.shape for p in params], bucket_size, world_size=world_size, rank=rank)
        n = layout.shard_numel
        # Filled from the device weights at the first step, so weights loaded into the model
        # after the optimizer was built are the ones trained.
        self.master = torch.zeros(n, dtype=master_dtype)
        self.master_synced = False
        # The params' version counters when weights and masters last agreed: a param written since
        # by someone else (model.load_state_dict, an in-place init) has its master taken again.
        self.versions: list[int] = []
        self.exp_avg = torch.zeros(n, dtype=state_dtype)
        self.exp_avg_sq = torch.zeros(n, dtype=state_dtype)
        # 8-bit moments (uint8 codes): both moments' scale per block; an all-zero block's is 1.
        self.state_scales = torch.ones(2, n // BLOCK) if state_dtype == torch.uint8 else None
        self.grads: HostBuffer = dev.host_buffer(n, torch.bfloat16)  # grads down, then weights up
        self.accumulator: Tensor | None = None
        self.buckets = [BucketState() for _ in layout.buckets]
        self.got = [False] * len(params)  # which params got a grad in this window
        self.steps = [0] * len(params)  # Adam steps taken by each param (as torch counts them)
        self.counter_offsets = canonical_offsets(layout.shapes)  # where each param's random bits start
        self.param_sq: Tensor | None = None  # on the device: each param's squared grad norm in this window
        self.sq_plans: dict[int, tuple[Tensor, list[slice]]] = {}  # per bucket: (param indices, slices of its piece)
        # The step's segments and kernel lists per chunk of buckets; the lists are dropped when a
        # param's storage changes.
        self.chunk_plans: dict[tuple[int, int], list[tuple[int, slice, slice, int]]] = {}
        self.kernel_lists: dict[tuple[int, int], tuple[list[Tensor], ...]] = {}
        self.storage: list[int] = []

    def note_versions(self) -> None:
        """The weights and the masters agree now (synced, or the optimizer just wrote the weights)."""
        self.versions = [p._version for p in self.params]

    def written_since(self) -> list[int]:
        """Params whose weights someone else wrote since ``note_versions``."""
        return [i for i, (p, seen) in enumerate(zip(self.params, self.versions)) if p._version != seen]

    def weights(self, i: int) -> Tensor:
        """Param ``i``'s own storage, flat."""
        return self.params[i].detach().view(-1)

    def piece_segments(self, b: int) -> list[tuple[int, slice, slice]]:
        """(param, slice of its elements, slice of the host buffers) of this rank's piece of bucket ``b``."""
        piece = self.layout.pieces[b]
        return [
            (i, slice(lo - self.layout.offsets[i], hi - self.layout.offsets[i]), slice(host, host + hi - lo))
            for i, lo, hi, host in self.layout.segments(piece.flat, piece.flat + piece.numel, piece.host)
        ]

    def sq_plan(self, b: int) -> tuple[Tensor, list[slice]]:
        """The params of this rank's piece of bucket ``b`` (an index tensor on the device) and their slices of it."""
        if b not in self.sq_plans:
            piece = self.layout.pieces[b]
            segments = self.piece_segments(b)
            index = torch.tensor([i for i, _, _ in segments], dtype=torch.int64).to(self.param_device)
            self.sq_plans[b] = index, [slice(h.start - piece.host, h.stop - piece.host) for _, _, h in segments]
        return self.sq_plans[b]

    def scales_of(self, host: slice) -> Tensor:
        """The block scales of host elements ``host`` (8-bit moments; a run starts on a block boundary)."""
        return self.state_scales[:, host.start // BLOCK : (host.stop + BLOCK - 1) // BLOCK]

    def reset_moments(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        if self.state_scales is not None:
            self.state_scales.fill_(1.0)

    @property
    def param_device(self) -> torch.device:
        return self.params[0].device

    def host_slice(self, b: int) -> tuple[slice, slice] | None:
        """(slice of the bucket's staging area, slice of the host buffers) of this rank's piece."""
        piece = self.layout.pieces[b]
        if piece.numel == 0:
            return None
        start = piece.flat - self.layout.buckets[b].start
        return slice(start, start + piece.numel), slice(piece.host, piece.host + piece.numel)
