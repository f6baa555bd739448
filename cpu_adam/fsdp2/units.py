"""FSDP2's units as the step behind the forward sees them: each ``fully_shard`` call's param group, the
modules whose forward gathers it, and the tensors on the host that its gather reads.

A unit is what FSDP2 gathers at once (its ``FSDPParamGroup``): one all-gather per forward of its
modules, in the pre-forward hook, or earlier where FSDP2 prefetches it or ``unshard()`` is called. The
tensor that gather reads on the host is each param's ``_sharded_param_data`` (the padded shard, of which
the DTensor's local tensor is a view); nothing else of the step's is read until the backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

__all__ = ["Unit", "find_units"]


@dataclass(eq=False)
class Unit:
    """One FSDP2 param group: its name (the module's qualified name; "" for a root), the modules whose forward
    gathers it, and its params (the DTensors the optimizer holds) with the shards FSDP2's gather reads."""

    name: str
    modules: tuple[nn.Module, ...]
    fsdp_params: list[object] = field(default_factory=list)

    @property
    def params(self) -> list[Tensor]:
        return [fsdp_param.sharded_param for fsdp_param in self.fsdp_params]

    @property
    def gathered(self) -> list[Tensor]:
        """What FSDP2's gather reads on the host (read anew at each step: ``load_state_dict`` may replace it)."""
        return [fsdp_param._sharded_param_data for fsdp_param in self.fsdp_params]

    def describe(self) -> str:
        return repr(self.name) if self.name else "the root"


def find_units(parts: list[nn.Module]) -> list[Unit]:
    """The FSDP2 units of ``parts`` (root modules, or torchtitan's model parts), in module order; refuses a part
    with none (not sharded by ``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, Unit] = {}
    for index, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise TypeError(
                f"step_behind_forward: model part {index} is a {type(part).__name__}, not an nn.Module; pass the "
                "FSDP2 root module, or a list of model parts"
            )
        if not isinstance(part, FSDPModule):
            raise ValueError(
                f"step_behind_forward: model part {index} ({type(part).__name__}) is not sharded by FSDP2: call "
                "torch.distributed.fsdp.fully_shard on it (and on its blocks) first"
            )
        for name, module in part.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:  # a fully_shard with no params of its own
                continue
            unit = units.get(id(group))
            if unit is None:
                unit = units[id(group)] = Unit(_qualified(index, name, len(parts)), (), list(group.fsdp_params))
            unit.modules = (*unit.modules, module)
    return list(units.values())


def _qualified(part: int, name: str, parts: int) -> str:
    return f"part {part}" + (f".{name}" if name else "") if parts > 1 else name
