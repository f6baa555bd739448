"""Damaged or foreign state dicts are refused by name, before anything changes, by both optimizers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from offload_helpers import batches, lm_loss, make_model

from cpu_adam import CPUAdam, OffloadOptimizer


def _cpu_adam(state_precision: str = "fp32") -> tuple[list[torch.nn.Parameter], CPUAdam]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 5)), torch.nn.Parameter(torch.randn(7))]
    opt = CPUAdam(params, lr=1e-2, state_precision=state_precision)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def _snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params] + [
        t.clone() for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)
    ]


def _damage(key: str, how: Callable[[torch.Tensor], Any]) -> Callable[[dict], None]:
    def damage(state: dict) -> None:
        state[0][key] = how(state[0][key])

    return damage


NEGATIVE_OR_NAN = "exp_avg_sq holds a non-finite or negative"
THIRD = torch.tensor([3])
CPU_ADAM_CASES = {
    "a moment of another shape": (_damage("exp_avg", lambda t: t[:-1]), "exp_avg has shape"),
    "a moment of another param": (_damage("exp_avg_sq", lambda t: t.reshape(5, 300)), "exp_avg_sq has shape"),
    "no exp_avg_sq": (lambda state: state[0].pop("exp_avg_sq"), "but no exp_avg_sq"),
    "a NaN second moment": (
        _damage("exp_avg_sq", lambda t: t.index_fill(0, torch.tensor([3]), math.nan)),
        NEGATIVE_OR_NAN,
    ),
    "a negative second moment": (_damage("exp_avg_sq", lambda t: -t), NEGATIVE_OR_NAN),
    "an infinite first moment": (_damage("exp_avg", lambda t: t * math.inf), "exp_avg holds a non-finite"),
}


@pytest.mark.parametrize("case", list(CPU_ADAM_CASES))
def test_cpu_adam_refuses_a_damaged_state_before_anything_changes(case: str):
    damage, message = CPU_ADAM_CASES[case]
    _, source = _cpu_adam()
    saved = source.state_dict()
    saved["state"] = {i: dict(s) for i, s in saved["state"].items()}
    damage(saved["state"])
    target_params, target = _cpu_adam()
    before = _snapshot(target, target_params)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(target, target_params)))


def test_cpu_adam_refuses_8bit_states_with_a_damaged_scale_tensor():
    _, source = _cpu_adam("8bit")
    saved = source.state_dict()
    saved["state"] = {i: dict(s) for i, s in saved["state"].items()}
    saved["state"][1]["state_scales"] = saved["state"][1]["state_scales"][:, :0]
    params, target = _cpu_adam("fp32")
    before = _snapshot(target, params)
    with pytest.raises(ValueError, match="state_scales is"):
        target.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(target, params)))


@pytest.mark.parametrize("target_precision", ["8bit", "bf16"])
def test_cpu_adam_refuses_8bit_codes_without_their_scales_and_says_where_they_went(target_precision: str):
    # What a checkpointer that rebuilds the state dict from optimizer.state's keys loads: codes alone.
    _, source = _cpu_adam("8bit")
    saved = source.state_dict()
    saved["state"] = {i: {k: v for k, v in s.items() if k != "state_scales"} for i, s in saved["state"].items()}
    params, target = _cpu_adam(target_precision)
    before = _snapshot(target, params)
    with pytest.raises(ValueError, match=r"without their state_scales or block exponents.*get_state_dict"):
        target.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(target, params)))


def _offload() -> tuple[torch.nn.Module, OffloadOptimizer]:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_size=1024)
    for tokens in batches(2):
        lm_loss(model, tokens).backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize(
    ("key", "how", "message"),
    [
        ("param_steps", lambda v: v[:-1], "param_steps for"),
        ("master", lambda t: t.index_fill(0, torch.tensor([5]), float("nan")), "master holds a non-finite"),
        ("exp_avg_sq", lambda t: t.index_fill(0, torch.tensor([5]), -1.0), "exp_avg_sq holds a non-finite or negative"),
    ],
    ids=["param_steps", "NaN master", "negative exp_avg_sq"],
)
def test_the_offload_optimizer_refuses_a_damaged_state_before_anything_changes(key: str, how, message: str):
    _, source = _offload()
    saved = source.state_dict()
    saved["state"] = {0: dict(saved["state"][0])}
    saved["state"][0][key] = how(saved["state"][0][key])
    model, target = _offload()
    before = [p.detach().clone() for p in model.parameters()] + [t.clone() for t in target.master_weights()]
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(saved)
    after = [p.detach().clone() for p in model.parameters()] + [t.clone() for t in target.master_weights()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert target.state_dict()["state"][0]["step"] == 2
