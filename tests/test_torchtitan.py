"""torchtitan (the real library) with CPUAdam chosen by name, on FSDP2 shards offloaded to the CPU.

What a torchtitan user gets from examples/torchtitan_cpu_adam.py: torchtitan's own optimizer
container builds CPUAdam over the DTensor shards, its LR schedulers drive it, and its DCP
checkpointer (FQN-keyed flat optimizer state, with its zero-grad lr=0 state initialisation before
a load) saves and restores it so that training goes on bit for bit. With ``step_behind_forward`` the
steps run behind the next forward through torchtitan's own loop, and train bit for bit as the serial
ones. Two ranks on gloo.

torchtitan's Trainer itself does not run on a machine without an accelerator: it picks "cuda" as
its device type when none is found and calls torch.cuda.set_device, which a CPU build of torch
does not have.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from behind_setup import slow_units
from rank_spawn import run_ranks
from test_fsdp2 import build_model
from torch import nn

pytest.importorskip("torchtitan")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from torchtitan_cpu_adam import CPUAdamOptimizers, cpu_adam_optimizers, llama3_70b_cpu_adam

from cpu_adam import CPUAdam
from cpu_adam.fsdp2.behind import State

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, SAVED_AT = 4, 2
MAX_NORM = 0.05  # below the model's grad norms: torchtitan's clipping clips every step


def two_stages() -> list[nn.Module]:
    """build_model's model as two pipeline stages on one rank (torchtitan's model parts), each an FSDP2 root: the
    first with params of its own, the second with none (its unit is its Linear)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    first, second = nn.Linear(12, 33), nn.Sequential(nn.Tanh(), nn.Linear(33, 9))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)
    for module in (first, second[1], second):
        fully_shard(module, mesh=mesh, offload_policy=policy)
    return [first, second]


class Run:
    """Model parts, torchtitan's optimizer and LR scheduler containers and its DCP checkpointer."""

    def __init__(
        self, folder: str, precision: str, interval: int = 1, step_behind_forward: bool = False, stages: int = 1
    ) -> None:
        from torchtitan.components.checkpointer import CheckpointManager
        from torchtitan.components.optimizer import LRSchedulersContainer

        # test_fsdp2's model: FSDP2 per layer and at the root, CPU offload, a padded shard
        self.parts = [build_model()] if stages == 1 else two_stages()
        config = cpu_adam_optimizers(lr=1e-2, step_behind_forward=step_behind_forward, state_precision=precision)
        self.optimizers = config.build(model_parts=self.parts)
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
            optimizers=self.optimizers, training_steps=STEPS
        )
        self.in_flight_after_step: list[bool] = []
        checkpoint = CheckpointManager.Config(
            enable=True, interval=interval, last_save_model_only=False, keep_latest_k=0
        )
        self.checkpointer = checkpoint.build(
            dataloader=None,
            model_parts=self.parts,
            optimizers=self.optimizers,
            lr_schedulers=self.schedulers,
            states={},
            sd_adapter=None,
            base_folder=folder,
        )

    def train(self, rank: int, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 12, generator=g), torch.randn(8, 9, generator=g)
            nn.functional.mse_loss(self.forward(x), y).backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()

    def torchtitan_step(self, rank: int, step: int, set_to_none: bool) -> None:
        """One step in the order of torchtitan's Trainer.train_step (``set_to_none``: its
        ``training.disable_cuda_graphs``), then the checkpoint its train() saves after it (steps count from 1)."""
        from torchtitan.distributed import utils as dist_utils

        self.optimizers.zero_grad(set_to_none=set_to_none)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 9, generator=g)
        nn.functional.mse_loss(self.forward(x), y).backward()
        dist_utils.clip_grad_norm_([p for part in self.parts for p in part.parameters()], MAX_NORM, foreach=True)
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.in_flight_after_step.append(all(h.state is State.IN_FLIGHT for h in self.optimizers.behind_forward))
        self.schedulers.step()
        self.checkpointer.save(step, last_step=step == STEPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for part, optimizer in zip(self.parts, self.optimizers.optimizers, strict=True):  # one optimizer a part
            for p in part.parameters():
                state = optimizer.state[p]
                out += [p.to_local(), state["exp_avg"].to_local(), state["exp_avg_sq"].to_local(), state["step"]]
                if "state_scales" in state:  # 8-bit moments' block scales
                    out.append(state["state_scales"])
        return out


def _checkpointer_resumes_exactly(rank: int, world_size: int, folder: str, precision: str) -> None:
    from torch.distributed.tensor import DTensor

    straight = Run(f"{folder}/straight", precision)
    [optimizer] = straight.optimizers.optimizers
    assert type(optimizer) is CPUAdam
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in optimizer.param_groups[0]["params"])
    straight.train(rank, range(STEPS))
    moments = optimizer.state[next(straight.parts[0].parameters())]["exp_avg"].to_local()
    assert moments.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}[precision]

    first = Run(f"{folder}/resumed", precision)
    first.train(rank, range(SAVED_AT))
    assert first.checkpointer.save(curr_step=SAVED_AT)

    resumed = Run(f"{folder}/resumed", precision)  # fresh weights and no state until the load
    assert resumed.checkpointer.load(step=SAVED_AT)
    resumed.train(rank, range(SAVED_AT, STEPS))
    assert [s.get_last_lr() for s in resumed.schedulers] == [s.get_last_lr() for s in straight.schedulers]
    for mine, theirs in zip(resumed.tensors(), straight.tensors(), strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"rank {rank}: the resumed run differs"
    for run in (straight, first, resumed):
        run.checkpointer.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torchtitans_container_and_checkpointer_step_and_resume_cpu_adam(tmp_path: Path, precision: str) -> None:
    run_ranks(_checkpointer_resumes_exactly, str(tmp_path), precision)


def _behind_forward_trains_and_resumes_as_the_serial_step(
    rank: int, world_size: int, folder: str, precision: str, set_to_none: bool, stages: int
) -> None:
    serial = Run(f"{folder}/serial", precision, interval=SAVED_AT, stages=stages)
    behind = Run(f"{folder}/behind", precision, interval=SAVED_AT, step_behind_forward=True, stages=stages)
    units = [["'0'", "'2'"]] if stages == 1 else [["the root"], ["'1'"]]  # each part's FSDP2 units
    assert [h.order for h in behind.optimizers.behind_forward] == units
    for step in range(1, STEPS + 1):
        serial.torchtitan_step(rank, step, set_to_none)
    with slow_units(0.02):  # each unit's step lags: what does not wait for it would read the old values
        for step in range(1, STEPS + 1):
            behind.torchtitan_step(rank, step, set_to_none)
        assert behind.in_flight_after_step == [True] * STEPS, "step() did not return before the step was done"
        expected = serial.tensors()
        for mine, theirs in zip(behind.tensors(), expected, strict=True):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"rank {rank}: behind the forward differs"

        resumed = Run(f"{folder}/behind", precision, interval=SAVED_AT, step_behind_forward=True, stages=stages)
        assert resumed.checkpointer.load(step=SAVED_AT)  # saved by torchtitan's save() right after a step()
        for step in range(SAVED_AT + 1, STEPS + 1):
            resumed.torchtitan_step(rank, step, set_to_none)
        for mine, theirs in zip(resumed.tensors(), expected, strict=True):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), f"rank {rank}: the resumed run differs"
    assert [s.get_last_lr() for s in resumed.schedulers] == [s.get_last_lr() for s in serial.schedulers]
    for run in (serial, behind, resumed):
        for handle in run.optimizers.behind_forward:
            handle.remove()
        run.checkpointer.close()


BEHIND_CASES = {
    "bf16, grads set to None (disable_cuda_graphs)": ("bf16", True, 1),
    "fp32, grads zeroed in place (torchtitan's default), two model parts": ("fp32", False, 2),
}


@pytest.mark.parametrize("case", BEHIND_CASES, ids=list(BEHIND_CASES))
def test_the_step_behind_the_forward_trains_and_resumes_as_the_serial_step_in_torchtitans_loop(
    tmp_path: Path, case: str
) -> None:
    run_ranks(_behind_forward_trains_and_resumes_as_the_serial_step, str(tmp_path), *BEHIND_CASES[case])


def _8bit_load_is_refused(rank: int, world_size: int, folder: str) -> None:
    saved = Run(folder, "8bit")
    saved.train(rank, range(SAVED_AT))
    assert saved.checkpointer.save(curr_step=SAVED_AT)
    fresh = Run(folder, "8bit")
    fresh.train(rank, range(1))
    # DCP loads into the live tensors before CPUAdam sees them (the model's first): after this, rebuild.
    with pytest.raises(ValueError, match=r"keys of optimizer\.state"):
        fresh.checkpointer.load(step=SAVED_AT)
    for run in (saved, fresh):
        run.checkpointer.close()


def test_8bit_moments_through_torchtitans_checkpointer_are_refused_with_the_reason(tmp_path: Path) -> None:
    # torchtitan rebuilds the state dict it loads from the keys of optimizer.state (where CPUAdam keeps
    # state_scales), and drops the block exponents CPUAdam's resharding 8-bit state_dict() saves instead.
    run_ranks(_8bit_load_is_refused, str(tmp_path))


def test_the_documented_command_line_selects_cpu_adam_with_cpu_offload() -> None:
    from torchtitan.config import ConfigManager

    # torchtitan.train's own parsing of `--module torchtitan_cpu_adam --config llama3_70b_cpu_adam`
    documented = ["--module", "torchtitan_cpu_adam", "--config", llama3_70b_cpu_adam.__name__]
    config = ConfigManager().parse_args(documented)
    assert isinstance(config.optimizer, CPUAdamOptimizers.Config)
    assert config.training.enable_cpu_offload and not config.optimizer.step_behind_forward
    [group] = config.optimizer.param_groups
    assert group.optimizer_name == "CPUAdam" and group.optimizer_kwargs["state_precision"] == "bf16"
    assert CPUAdamOptimizers._resolve_optimizer_factory("CPUAdam") is CPUAdam
    assert CPUAdamOptimizers._resolve_optimizer_factory("AdamW") is torch.optim.AdamW

    config = ConfigManager().parse_args([*documented, "--optimizer.step_behind_forward"])
    assert config.optimizer.step_behind_forward
