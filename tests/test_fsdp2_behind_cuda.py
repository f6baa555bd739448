"""The step behind the forward on a GPU: FSDP2 computes on CUDA, its shards in page-locked host memory, the gathers'
copies up are asynchronous. Bitwise the serial step; skipped where there is no CUDA device."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from behind_setup import PRECISIONS, Case, each_case, slow_units, train_both

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

CASES = [Case(dtype=dtype, precision=precision, device="cuda") for dtype, precision in PRECISIONS]
CASES += each_case(
    Case(device="cuda"), clip=["outside", None], reshard_after_forward=[False], checkpointed=[True], prefetch=[True]
)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=[case.describe() for case in CASES])
def test_the_step_behind_the_forward_is_the_serial_step_on_cuda(world_of_one: None, case: Case) -> None:
    train_both(case, case.describe())


def test_slow_units_on_cuda_still_give_the_serial_step(world_of_one: None) -> None:
    """The host's units finish long after the forward's copies were queued: each copy waited for its unit."""
    with slow_units(0.05):
        train_both(Case(device="cuda", steps=2), "slowed units")
