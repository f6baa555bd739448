"""torchtitan (the real library) with CPUAdam chosen by name, on FSDP2 shards offloaded to the CPU.

What a torchtitan user gets from examples/torchtitan_cpu_adam.py: torchtitan's own optimizer
container builds CPUAdam over the DTensor shards, its LR schedulers drive it, and its DCP
checkpointer (FQN-keyed flat optimizer state, with its zero-grad lr=0 state initialisation before
a load) saves and restores it so that training goes on bit for bit. Two ranks on gloo.

torchtitan's Trainer itself does not run on a machine without an accelerator: it picks "cuda" as
its device type when none is found and calls torch.cuda.set_device, which a CPU build of torch
does not have.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rank_spawn import run_ranks
from test_fsdp2 import build_model
from torch import nn

pytest.importorskip("torchtitan")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from torchtitan_cpu_adam import CPUAdamOptimizers, cpu_adam_optimizers, llama3_70b_cpu_adam

from cpu_adam import CPUAdam

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, SAVED_AT = 4, 2


class Run:
    """A model, torchtitan's optimizer and LR scheduler containers and its DCP checkpointer."""

    def __init__(self, folder: str, precision: str) -> None:
        from torchtitan.components.checkpointer import CheckpointManager
        from torchtitan.components.optimizer import LRSchedulersContainer

        self.model = build_model()  # test_fsdp2's: FSDP2 per layer and at the root, CPU offload, a padded shard
        self.optimizers = cpu_adam_optimizers(lr=1e-2, state_precision=precision).build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
            optimizers=self.optimizers, training_steps=STEPS
        )
        checkpoint = CheckpointManager.Config(enable=True, interval=1, last_save_model_only=False, keep_latest_k=0)
        self.checkpointer = checkpoint.build(
            dataloader=None,
            model_parts=[self.model],
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
            nn.functional.mse_loss(self.model(x), y).backward()
            self.optimizers.step()
            self.schedulers.step()
            self.optimizers.zero_grad()

    def tensors(self) -> list[torch.Tensor]:
        [optimizer] = self.optimizers.optimizers
        out = []
        for p in self.model.parameters():
            out.append(p.to_local())
            out += [optimizer.state[p][key].to_local() for key in ("exp_avg", "exp_avg_sq")]
            if "state_scales" in optimizer.state[p]:  # 8-bit moments' block scales
                out.append(optimizer.state[p]["state_scales"])
            out.append(optimizer.state[p]["step"])
        return out


def _checkpointer_resumes_exactly(rank: int, world_size: int, folder: str, precision: str) -> None:
    from torch.distributed.tensor import DTensor

    straight = Run(f"{folder}/straight", precision)
    [optimizer] = straight.optimizers.optimizers
    assert type(optimizer) is CPUAdam
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in optimizer.param_groups[0]["params"])
    straight.train(rank, range(STEPS))
    moments = optimizer.state[next(straight.model.parameters())]["exp_avg"].to_local()
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
    config = ConfigManager().parse_args(["--module", "torchtitan_cpu_adam", "--config", llama3_70b_cpu_adam.__name__])
    assert isinstance(config.optimizer, CPUAdamOptimizers.Config)
    assert config.training.enable_cpu_offload
    [group] = config.optimizer.param_groups
    assert group.optimizer_name == "CPUAdam" and group.optimizer_kwargs["state_precision"] == "bf16"
    assert CPUAdamOptimizers._resolve_optimizer_factory("CPUAdam") is CPUAdam
    assert CPUAdamOptimizers._resolve_optimizer_factory("AdamW") is torch.optim.AdamW
