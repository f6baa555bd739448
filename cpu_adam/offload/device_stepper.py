"""Adam over the device's buckets: the stepper's second implementation, with the device kernel.

Each bucket the device steps is one kernel call per step count (``Stepper.runs`` plans them, as for
the host), over the bucket's state in device memory (``DeviceStore``), its grads kept on the device
and, for the weights, a bucket buffer on the device that is spread into the params afterwards (as
uploaded weights are): fp32 masters write their bf16 rounding there; bf16 masters, which are the
weights, are gathered into it, stepped in place and spread back. The random counters are the
host's, so the bits are those the host kernel would write.

``prepare`` does all that can fail (the lists, the buffers) before ``run`` changes anything: the
optimizer prepares, steps the host's part, and only then runs the device's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor

from .. import device_kernel
from ..quant8 import BLOCK
from .device_store import DeviceStore
from .layout import FlatLayout
from .link import Link
from .share import Key
from .stepper import Chunk, Stepper
from .window import Finished

__all__ = ["DeviceStepper"]


class _Bucket(NamedTuple):
    key: Key
    into: Tensor  # the bucket's weights buffer on the device
    mine: Tensor  # this rank's piece of it
    launches: list[device_kernel.Launches]
    got: list[bool]


class DeviceStepper:
    def __init__(self, store: DeviceStore, link: Link, stepper: Stepper, layouts: list[FlatLayout | None]) -> None:
        self._store = store
        self._link = link
        self._stepper = stepper
        self._layouts = layouts

    def prepare(self, hypers: list[dict[str, Any] | None], finished: Finished) -> list[_Bucket]:
        """The kernel calls of this step's device buckets, with their buffers; nothing is written."""
        prepared = []
        for g, b in sorted(finished.device_grads):
            hyper = hypers[g]
            chunk = Chunk(g, b, b + 1)
            got = finished.got[g]
            if hyper is None or not any(got[i] for i in self._stepper.members_of(chunk)):
                continue
            into, mine = self._link.device_weights(g, b)
            views = self._store.views((g, b))
            first = self._layouts[g].pieces[b].host
            grads = finished.device_grads[(g, b)]
            launches = []
            for step, runs in self._stepper.runs(chunk, got).items():
                local = [slice(run.host.start - first, run.host.stop - first) for run in runs]
                fp32_master = views.master is not None
                launches.append(
                    device_kernel.prepare_step(
                        params=[(views.master if fp32_master else mine)[h] for h in local],
                        grads=[grads[h] for h in local],
                        exp_avgs=[views.exp_avg[h] for h in local],
                        exp_avg_sqs=[views.exp_avg_sq[h] for h in local],
                        bf16_outs=[mine[h] for h in local] if fp32_master else None,
                        counter_offsets=[self._stepper.counter_offset(g, run) for run in runs],
                        state_scales=None if views.scales is None else [views.scales[:, _blocks(h)] for h in local],
                        step=step,
                        **hyper,
                    )
                )
            prepared.append(_Bucket((g, b), into, mine, launches, got))
        return prepared

    def run(self, prepared: list[_Bucket]) -> None:
        """Steps the prepared buckets on the device and spreads their new weights into the params."""
        for bucket in prepared:
            g, b = bucket.key
            if self._store.views(bucket.key).master is None:
                self._link.gather_weights(g, b, bucket.mine)
            for launches in bucket.launches:
                launches()
            self._store.stepped(bucket.key)
            self._link.spread(g, b, bucket.got, bucket.into, bucket.mine)
            self._stepper.advance(Chunk(g, b, b + 1), bucket.got)
        self._store.release()  # streamed state on its way back, behind the device's step


def _blocks(elements: slice) -> slice:
    """The 8-bit scale blocks of ``elements`` (which start on a block boundary)."""
    return slice(elements.start // BLOCK, -(-elements.stop // BLOCK))
