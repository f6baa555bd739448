"""OffloadOptimizer on the CPU device: the same code path as on a GPU, with plain copies."""

from __future__ import annotations

import copy
import io
import logging
from typing import Any

import pytest
import torch
from conftest import failing_unless_checking, printed_groups, raw
from offload_helpers import (
    MASTER_ATOL,
    AdamWOracle,
    CopyingCPU,
    GradTap,
    assert_matches_oracle,
    batches,
    lm_loss,
    make_model,
)
from torch import nn

from cpu_adam import offload
from cpu_adam.offload import OffloadOptimizer
from cpu_adam.offload.placeholder import OffloadedGrad

BUCKET = 1024  # elements: the tiny model spans several buckets, the embedding one alone
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def build(seed: int = 0, max_norm: float | None = None, **kwargs):
    model = make_model(seed)
    params = list(model.parameters())
    tap = GradTap(params)
    opt = OffloadOptimizer(params, **HYPER, max_grad_norm=max_norm, bucket_size=BUCKET, **kwargs)
    oracle = AdamWOracle([{"params": params}], **HYPER)
    return model, params, tap, opt, oracle


def test_params_keep_their_own_storage():
    model, params, _, opt, _ = build()
    storage = [p.untyped_storage().data_ptr() for p in params]
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    assert [p.untyped_storage().data_ptr() for p in params] == storage
    assert len({p.untyped_storage().data_ptr() for p in params}) == len(params)
    assert len(opt._rooms.layouts[0].buckets) > 2
    assert model.head.weight is model.emb.weight
    assert opt.memory_stats()["params"] == sum(p.numel() for p in params)


def test_safetensors_round_trips_the_trained_model(tmp_path):
    import safetensors.torch

    model, _, _, opt, _ = build()
    for tokens in batches(2):
        lm_loss(model, tokens).backward()
        opt.step()
    safetensors.torch.save_model(model, str(tmp_path / "model.safetensors"))
    fresh = make_model(seed=3)
    safetensors.torch.load_model(fresh, str(tmp_path / "model.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_parity_with_torch_adamw_over_24_steps():
    model, params, tap, opt, oracle = build()
    for tokens in batches(24):
        lm_loss(model, tokens).backward()
        assert all(isinstance(p.grad, OffloadedGrad) for p in params), "the optimizer takes the grads during backward"
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, params, oracle)


def test_clipping_equals_clip_grad_norm():
    max_norm = 0.05  # well below the tiny model's grad norms (about 1): every step is clipped
    model, params, tap, opt, oracle = build(max_norm=max_norm)
    unclipped = AdamWOracle([{"params": params}], **HYPER)
    for tokens in batches(10):
        lm_loss(model, tokens).backward()
        grads = tap.take()
        norm = oracle.step(grads, max_norm=max_norm)
        unclipped.step(grads)
        opt.step()
        assert norm > 2 * max_norm
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-5)
        assert_matches_oracle(opt, params, oracle)
    # The test can tell clipped from unclipped steps apart.
    gap = max((oracle.master(p) - unclipped.master(p)).abs().max().item() for p in params)
    assert gap > 100 * MASTER_ATOL


def test_a_state_dict_before_the_first_step_holds_no_tensors_and_loads_as_fresh():
    # accelerate's prepare() sends the optimizer's state dict to the device and loads it back:
    # before the first step that must not put the host state on the GPU.
    model, _, _, opt, _ = build()
    fresh_state = opt.state_dict()
    assert not any(torch.is_tensor(v) for v in fresh_state["state"][0].values())
    data = batches(4)
    for tokens in data[:2]:
        lm_loss(model, tokens).backward()
        opt.step()
    twin, _, _, twin_opt, _ = build()
    model.load_state_dict(twin.state_dict())
    opt.load_state_dict(fresh_state)  # the trained optimizer is a fresh one again
    for m, o in ((model, opt), (twin, twin_opt)):
        for tokens in data[2:]:
            lm_loss(m, tokens).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    mine, ref = opt.state_dict(), twin_opt.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq", "param_steps"):
        assert torch.equal(torch.as_tensor(mine["state"][0][key]), torch.as_tensor(ref["state"][0][key])), key


def test_non_finite_grad_skips_the_step(caplog: pytest.LogCaptureFixture):
    model, params, tap, opt, oracle = build(max_norm=1.0)
    data = batches(4)
    for tokens in data[:2]:
        lm_loss(model, tokens).backward()
        oracle.step(tap.take(), max_norm=1.0)
        opt.step()
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}
    weights = [p.detach().clone() for p in params]

    (lm_loss(model, data[2]) * float("inf")).backward()
    tap.take()
    with caplog.at_level(logging.WARNING, logger="cpu_adam.offload"):
        opt.step()
    assert opt.skipped_steps == 1
    assert "skipped" in caplog.text
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert after["step"] == 2
    assert all(torch.equal(w, p.detach()) for w, p in zip(weights, params))

    # The next step is a normal one: bias correction continues from step 3.
    lm_loss(model, data[3]).backward()
    oracle.step(tap.take(), max_norm=1.0)
    opt.step()
    assert_matches_oracle(opt, params, oracle)


def test_accumulation_equals_one_large_batch():
    micro, steps = 4, 3
    big_model, _, big_tap, big_opt, _ = build()
    model, params, tap, opt, oracle = build()
    for tokens in batches(steps, batch=8 * micro):
        lm_loss(big_model, tokens).backward()
        big_tap.take()
        big_opt.step()
        for chunk in tokens.chunk(micro):
            (lm_loss(model, chunk) / micro).backward()
        assert opt.memory_stats()["accumulator_bytes"] == 4 * opt._rooms.layouts[0].numel
        grads = tap.take()  # the fp32 sum of the micro-batches' bf16 grads
        oracle.step(grads)
        opt.step()
        assert opt.last_grad_norm == pytest.approx(
            torch.cat([g.reshape(-1) for g in grads.values()]).norm().item(), rel=1e-5
        )
        # Exactly the sum of the micro-batch grads, in fp32:
        assert_matches_oracle(opt, params, oracle)
    # ... which is one large batch up to the bf16 rounding of each grad. Adam normalises the
    # grads, so the rounding moves each update by ~2^-8 of lr; only grads that are themselves
    # at rounding level can flip a sign. Using only the last micro-batch would move thousands.
    close = far = total = 0
    for mine, big in zip(opt.master_weights(), big_opt.master_weights()):
        diff = (mine - big).abs()
        close += int((diff <= steps * HYPER["lr"] * 2**-6).sum())
        far += int((diff > 2 * steps * HYPER["lr"] + MASTER_ATOL).sum())
        total += diff.numel()
    assert far == 0
    assert close >= 0.99 * total, f"only {close} of {total} masters agree with the large batch"


def test_zero_grad_starts_a_new_window():
    model, params, tap, opt, oracle = build()
    data = batches(2)
    lm_loss(model, data[0]).backward()
    tap.take()
    opt.zero_grad()
    lm_loss(model, data[1]).backward()
    oracle.step(tap.take())
    opt.step()
    assert opt.memory_stats()["accumulator_bytes"] == 0
    assert_matches_oracle(opt, params, oracle)


def test_groups_frozen_and_tied_params():
    model = make_model()
    model.ln1.requires_grad_(False)
    frozen = [model.ln1.weight.detach().clone(), model.ln1.bias.detach().clone()]
    decay = [model.fc1.weight, model.fc2.weight, model.emb.weight, model.head.weight]  # tied: listed twice
    no_decay = [model.fc1.bias, model.fc2.bias, model.ln_f.weight, model.ln_f.bias, model.ln1.weight]
    groups = [
        {"params": decay, "weight_decay": 0.1, "lr": 2e-3, "betas": (0.8, 0.95)},
        {"params": no_decay, "weight_decay": 0.0, "eps": 1e-6},
    ]
    trainable = [p for g in groups for p in dict.fromkeys(g["params"]) if p.requires_grad]
    tap = GradTap(trainable)
    opt = OffloadOptimizer(groups, **HYPER, bucket_size=BUCKET)
    oracle = AdamWOracle(groups, **HYPER)
    assert len(opt.master_weights()) == len(trainable) == 7
    for tokens in batches(8):
        lm_loss(model, tokens).backward()
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, trainable, oracle)
    assert torch.equal(model.ln1.weight, frozen[0]) and torch.equal(model.ln1.bias, frozen[1])
    assert model.ln1.weight.grad is None


def test_lr_scheduler_drives_the_learning_rate():
    model, params, tap, opt, oracle = build()
    schedule = lambda step: 1.0 / (1 + step)  # noqa: E731
    ours = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    theirs = torch.optim.lr_scheduler.LambdaLR(oracle.opt, schedule)
    for tokens in batches(6):
        lm_loss(model, tokens).backward()
        oracle.step(tap.take())
        opt.step()
        ours.step()
        theirs.step()
        assert_matches_oracle(opt, params, oracle)
    assert opt.param_groups[0]["lr"] == pytest.approx(HYPER["lr"] / 7)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"fp32_optimizer_states": False, "master_weights_dtype": torch.bfloat16, "stochastic_rounding": True},
    ],
    ids=["fp32", "bf16-stochastic"],
)
def test_resume_is_bit_exact(options):
    data = batches(8)

    def run(model, opt, chunk):
        for tokens in chunk:
            lm_loss(model, tokens).backward()
            opt.step()

    straight = make_model(0)
    straight_opt = OffloadOptimizer(straight.parameters(), **HYPER, max_grad_norm=0.5, bucket_size=BUCKET, **options)
    run(straight, straight_opt, data)

    first = make_model(0)
    first_opt = OffloadOptimizer(first.parameters(), **HYPER, max_grad_norm=0.5, bucket_size=BUCKET, **options)
    run(first, first_opt, data[:4])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)

    resumed = make_model(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = OffloadOptimizer(resumed.parameters(), lr=0.5, bucket_size=BUCKET, **options)  # hypers: loaded
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert resumed_opt.seed == straight_opt.seed
    run(resumed, resumed_opt, data[4:])

    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(straight_opt.master_weights(), resumed_opt.master_weights()):
        assert torch.equal(a, b)
    s, r = straight_opt.state_dict(), resumed_opt.state_dict()
    assert s["state"][0]["step"] == r["state"][0]["step"] == 8
    assert torch.equal(s["state"][0]["exp_avg_sq"], r["state"][0]["exp_avg_sq"])


def test_optimizer_state_alone_restores_the_weights():
    model, _, _, opt, _ = build()
    for tokens in batches(3):
        lm_loss(model, tokens).backward()
        opt.step()
    fresh = make_model(seed=7)
    fresh_opt = OffloadOptimizer(fresh.parameters(), **HYPER, bucket_size=BUCKET)
    fresh_opt.load_state_dict(opt.state_dict())
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_weights_loaded_after_construction_are_trained():
    model, params, tap, opt, _ = build()
    other = make_model(seed=5)
    model.load_state_dict(other.state_dict())  # e.g. a model checkpoint restored after the optimizer
    oracle = AdamWOracle([{"params": params}], **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    oracle.step(tap.take())
    opt.step()
    assert_matches_oracle(opt, params, oracle)


def test_weights_written_back_unchanged_keep_their_fp32_masters():
    # model.load_state_dict(model.state_dict()) writes every param (their version counters move)
    # with the values they hold: the masters must keep the bits below bf16's.
    def run(write_back: bool) -> list[torch.Tensor]:
        model, _, _, opt, _ = build()
        for i, tokens in enumerate(batches(4)):
            if write_back and i == 2:
                model.load_state_dict(model.state_dict())
            lm_loss(model, tokens).backward()
            opt.step()
        return [m.clone() for m in opt.master_weights()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("options", "per_param"),
    [
        ({}, 14),
        ({"fp32_optimizer_states": False}, 10),
        ({"fp32_optimizer_states": False, "master_weights_dtype": torch.bfloat16}, 8),
    ],
)
def test_host_bytes_per_param(options, per_param):
    model = nn.Linear(256, 256, bias=False).to(torch.bfloat16)  # aligned: no padding
    opt = OffloadOptimizer(model.parameters(), **options)
    stats = opt.memory_stats()
    assert stats["host_bytes"] == per_param * 256 * 256
    assert stats["host_bytes_per_param"] == per_param
    assert stats["device_bytes"] == 0 and stats["accumulator_bytes"] == 0
    assert stats["weights_bytes"] == 2 * 256 * 256


def test_params_without_grads_are_left_alone():
    # As torch's AdamW: a param with no grad in a window keeps its weight, moments and step count.
    model, params, tap, opt, oracle = build()
    first, second, third = batches(3)
    lm_loss(model, first).backward()
    oracle.step(tap.take())
    opt.step()
    model.fc1.bias.requires_grad_(False)  # left out of this backward's graph
    loss = lm_loss(model, second)
    model.fc1.bias.requires_grad_(True)
    loss.backward()
    grads = tap.take()
    assert id(model.fc1.bias) not in grads
    before = model.fc1.bias.detach().clone()
    oracle.step_some(grads)
    opt.step()
    assert torch.equal(model.fc1.bias.detach(), before)
    assert_matches_oracle(opt, params, oracle)
    lm_loss(model, third).backward()  # its step count resumes where it stopped, as torch's does
    oracle.step(tap.take())
    opt.step()
    assert_matches_oracle(opt, params, oracle)


def test_rejects_params_that_are_not_bf16():
    with pytest.raises(TypeError, match=r"model\.to\(torch\.bfloat16\)"):
        OffloadOptimizer(nn.Linear(4, 4).parameters())


def test_rejects_params_on_two_devices():
    params = [
        nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)),
        nn.Parameter(torch.zeros(4, dtype=torch.bfloat16, device="meta")),
    ]
    with pytest.raises(RuntimeError, match="several devices"):
        OffloadOptimizer(params)


def test_rejects_sparse_grads():
    emb = nn.Embedding(10, 4, sparse=True).to(torch.bfloat16)
    opt = OffloadOptimizer(emb.parameters())
    with pytest.raises(RuntimeError, match="dense gradients"):
        emb(torch.tensor([1, 2])).float().sum().backward()
    assert opt.skipped_steps == 0


def test_rejects_unsupported_options():
    params = list(make_model().parameters())
    with pytest.raises(TypeError, match="ProcessGroup"):
        OffloadOptimizer(params, process_group=object())
    with pytest.raises(ValueError, match=r"master_weights_dtype=torch\.bfloat16"):
        OffloadOptimizer(params, stochastic_rounding=True)
    opt = OffloadOptimizer(params)
    with pytest.raises(NotImplementedError, match="constructor"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]})


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"lr": -1e-3}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1.0}, "eps"),
        ({"weight_decay": -1.0}, "weight"),
    ],
)
def test_rejects_bad_hyper_parameters_as_adamw_does(option: dict, match: str):
    with pytest.raises(Exception) as theirs:
        torch.optim.AdamW(make_model().parameters(), **option)
    with pytest.raises(type(theirs.value), match=rf"OffloadOptimizer: {match}") as ours:
        OffloadOptimizer(make_model().parameters(), **option)
    assert str(ours.value).startswith(str(theirs.value)), "torch's message, then ours"


@pytest.mark.parametrize(
    ("option", "error", "match"),
    [
        ({"lr": float("inf")}, ValueError, r"Invalid learning rate: inf \(cpu_adam\.OffloadOptimizer: lr must be"),
        ({"betas": None}, TypeError, r"OffloadOptimizer: betas must be a pair of numbers \(beta1, beta2\), got None"),
        ({"seed": "x"}, TypeError, "OffloadOptimizer: seed must be an integer, got 'x'"),
    ],
)
def test_rejects_what_adamw_lets_through(option: dict, error: type, match: str):
    with pytest.raises(error, match=match):
        OffloadOptimizer(make_model().parameters(), **option)


BAD_GROUP_VALUES = [
    ("lr", -1.0, ValueError, r"Invalid learning rate: -1\.0"),
    ("lr", torch.tensor(float("nan")), ValueError, "Invalid learning rate: nan"),
    ("betas", (0.9, 1.5), ValueError, r"Invalid beta parameter at index 1: 1\.5"),
    ("betas", (0.9,), ValueError, "betas must be a pair of numbers"),
    ("eps", float("inf"), ValueError, "Invalid epsilon value: inf"),
    ("weight_decay", -0.5, ValueError, r"Invalid weight_decay value: -0\.5"),
]


def _offload_snapshot(opt: OffloadOptimizer, params: list[nn.Parameter]) -> dict[str, Any]:
    saved = opt.state_dict()
    return {
        "weights": [raw(p) for p in params],
        "state": {g: {k: raw(v) if torch.is_tensor(v) else v for k, v in s.items()} for g, s in saved["state"].items()},
        "rest": repr({k: v for k, v in saved.items() if k != "state"}),
        "counters": (opt.skipped_steps, opt.last_grad_norm, opt.seed),
    }


def _assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["rest"] == after["rest"] and before["counters"] == after["counters"]
    assert all(torch.equal(a, b) for a, b in zip(before["weights"], after["weights"])), "a weight changed"
    for g, state in before["state"].items():
        for key, value in state.items():
            other = after["state"][g][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (
                f"state[{g}][{key!r}] changed"
            )


def test_bad_values_are_refused_at_step_before_anything_changes():
    model, params, tap, opt, oracle = build(max_norm=1.0)
    first, second = batches(2)
    lm_loss(model, first).backward()
    oracle.step(tap.take(), max_norm=1.0)
    opt.step()
    lm_loss(model, second).backward()
    for key, value, error, match in BAD_GROUP_VALUES:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value  # as a scheduler might
        before = _offload_snapshot(opt, params)
        with pytest.raises(error, match=match):
            opt.step()
        _assert_same_snapshot(before, _offload_snapshot(opt, params))
        opt.param_groups[0][key] = good
    oracle.step(tap.take(), max_norm=1.0)  # the window's grads are still there: a normal step
    opt.step()
    assert_matches_oracle(opt, params, oracle)


LOADED_DAMAGE = [
    *((f"param_groups {key}={value!r}", key, value, error, match) for key, value, error, match in BAD_GROUP_VALUES),
    ("seed 'x'", "seed", "x", TypeError, "seed must be an integer"),
    ("step nan", "step", float("nan"), ValueError, "a step count must be a whole number >= 0, got nan"),
    ("param_steps -1", "param_steps", [-1], ValueError, "a step count must be a whole number >= 0, got -1"),
    ("skipped_steps 1.5", "skipped_steps", 1.5, ValueError, "skipped_steps: a step count must be"),
]


@pytest.mark.parametrize(("what", "key", "value", "error", "match"), LOADED_DAMAGE, ids=lambda v: str(v)[:30])
def test_bad_values_are_refused_at_load_before_anything_changes(what, key, value, error, match):
    model, params, _, opt, _ = build()
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    if what.startswith("param_groups"):
        saved["param_groups"][0][key] = value
    elif key in ("step", "param_steps"):
        saved["state"][0][key] = value if key == "step" else value * len(saved["state"][0][key])
    else:
        saved[key] = value
    for name in ("master", "exp_avg", "exp_avg_sq"):  # would be loaded, if the load went ahead
        saved["state"][0][name].fill_(3.0)
    before = _offload_snapshot(opt, params)
    with pytest.raises(error, match=match):
        opt.load_state_dict(saved)
    _assert_same_snapshot(before, _offload_snapshot(opt, params))


def test_a_tensor_lr_steps_as_the_float_lr():
    runs = []
    for lr in (1e-3, torch.tensor(1e-3, dtype=torch.float64)):  # float64 holds the float exactly
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **{**HYPER, "lr": lr}, bucket_size=BUCKET)
        for tokens in batches(3):
            lm_loss(model, tokens).backward()
            opt.step()
        runs.append(list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_hooks_run_as_with_torchs_optimizers():
    model, _, _, opt, _ = build()
    calls: list[Any] = []
    opt.register_step_pre_hook(lambda *_: calls.append("step pre"))
    opt.register_step_post_hook(lambda *_: calls.append("step post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("state_dict pre"))
    opt.register_state_dict_post_hook(lambda o, state_dict: {**state_dict, "note": "from a post hook"})

    def load_pre_hook(o, state_dict):
        calls.append("load pre")
        state_dict["param_groups"] = [{**state_dict["param_groups"][0], "lr": 2e-3}]

    opt.register_load_state_dict_pre_hook(load_pre_hook)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o.param_groups[0]["lr"])))
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    saved = opt.state_dict()
    assert saved["note"] == "from a post hook"
    opt.load_state_dict(saved)
    assert calls == ["step pre", "step post", "state_dict pre", "load pre", ("load post", 2e-3)]
    assert saved["param_groups"][0]["lr"] == HYPER["lr"]


def test_repr_lists_param_groups_as_torch_does():
    def groups(model):
        return [
            {"params": [model.fc1.weight]},
            {"params": [model.fc2.weight], "weight_decay": 0.5, "betas": (0.8, 0.9)},
        ]

    ours = OffloadOptimizer(groups(make_model()), **HYPER)
    theirs = torch.optim.AdamW(groups(make_model()), **HYPER)
    assert len(printed_groups(ours)) == 2
    for mine, torchs, group in zip(printed_groups(ours), printed_groups(theirs), ours.param_groups):
        assert list(mine) == sorted(mine) and mine.keys() == group.keys() - {"params"}
        assert {k: mine[k] for k in ("lr", "betas", "eps", "weight_decay")} == {
            k: torchs[k] for k in ("lr", "betas", "eps", "weight_decay")
        }


def test_the_copy_path_used_on_gpus(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(offload.rooms, "DeviceOps", CopyingCPU)
    model, params, tap, opt, oracle = build(max_norm=0.5)
    for i, tokens in enumerate(batches(6)):
        for chunk in tokens.chunk(2 if i % 2 else 1):  # with and without accumulation
            lm_loss(model, chunk).backward()
            assert opt.memory_stats()["device_bytes"] <= 3 * BUCKET * 2
        oracle.step(tap.take(), max_norm=0.5)
        opt.step()
        assert_matches_oracle(opt, params, oracle)
    stats = opt.memory_stats()
    assert stats["device_bytes"] == 0 and 0 < stats["device_peak_bytes"] <= 3 * BUCKET * 2


# -- guards a mutation audit found unguarded ----------------------------------------------------


def _visible(model: nn.Module, opt: OffloadOptimizer) -> list:
    """Every bit a user can see: weights, the public state dict, the last norm and the skips."""
    state = opt.state_dict()
    tensors = [raw(t) for g in state["state"].values() for t in g.values() if torch.is_tensor(t)]
    counts = [g["param_steps"] for g in state["state"].values()]
    return [raw(p) for p in model.parameters()] + tensors + [counts, opt.last_grad_norm, opt.skipped_steps]


def _same_visible(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_a_max_grad_norm_the_grads_stay_under_changes_nothing(overlap: str):
    runs = []
    for max_norm in (None, 1e6):
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, max_grad_norm=max_norm, overlap=overlap)
        for tokens in batches(4):
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()
        assert opt.last_grad_norm < 1e6
        runs.append(_visible(model, opt))
        opt.close()
    assert _same_visible(runs[1], runs[0]), "a limit the grads stay under scaled them"


@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["+inf", "-inf"])
def test_infinite_grads_skip_the_step_with_nothing_changed(sign: float, max_norm: float | None, overlap: str):
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, max_grad_norm=max_norm, overlap=overlap)
    data = batches(3)
    for tokens in data[:2]:
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    before = _visible(model, opt)

    def one_infinite_element(grad: torch.Tensor) -> torch.Tensor:  # the others finite: the norm is +inf, not NaN
        grad = grad.clone()
        grad.view(-1)[3] = sign * float("inf")
        return grad

    handle = model.fc1.weight.register_hook(one_infinite_element)
    lm_loss(model, data[2]).backward()
    handle.remove()
    opt.step()
    assert opt.last_grad_norm == float("inf") and opt.skipped_steps == 1
    after = _visible(model, opt)
    assert _same_visible(after[:-2], before[:-2]), "an infinite grad changed the weights or the state"
    opt.close()


def test_a_serial_step_whose_kernel_raises_changes_nothing_and_its_retry_equals_a_twin(
    monkeypatch: pytest.MonkeyPatch,
):
    def run(fail_at: int | None) -> list:
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, max_grad_norm=0.5)
        for step, tokens in enumerate(batches(4)):
            lm_loss(model, tokens).backward()
            if step == fail_at:
                before = _visible(model, opt)
                real = offload.stepper.adam_step
                monkeypatch.setattr(offload.stepper, "adam_step", failing_unless_checking(real))
                with pytest.raises(RuntimeError, match="simulated kernel failure"):
                    opt.step()
                monkeypatch.setattr(offload.stepper, "adam_step", real)
                assert _same_visible(_visible(model, opt)[:-2], before[:-2]), "the failed step changed something"
            opt.step()  # the retry, on the same grads
            opt.zero_grad()
        seen = _visible(model, opt)
        opt.close()
        return seen

    assert _same_visible(run(fail_at=2), run(fail_at=None))


def test_per_param_step_counts_round_trip_a_state_dict():
    # fc1's params get no grad in some windows: their counts, and bias corrections, differ from the others'.
    def train(model: nn.Module, opt: OffloadOptimizer, data: list, start: int) -> None:
        for step, tokens in enumerate(data, start):
            frozen = step % 3 == 1
            model.fc1.requires_grad_(not frozen)
            loss = lm_loss(model, tokens)
            model.fc1.requires_grad_(True)
            loss.backward()
            opt.step()
            opt.zero_grad()

    data = batches(8)
    straight = make_model(0)
    straight_opt = OffloadOptimizer(straight.parameters(), **HYPER, bucket_size=BUCKET)
    train(straight, straight_opt, data, 0)

    first = make_model(0)
    first_opt = OffloadOptimizer(first.parameters(), **HYPER, bucket_size=BUCKET)
    train(first, first_opt, data[:5], 0)
    saved = copy.deepcopy(first_opt.state_dict())
    counts = saved["state"][0]["param_steps"]
    assert len(set(counts)) > 1, "the params skipped different numbers of steps"
    resumed = make_model(0)
    resumed.load_state_dict(first.state_dict())
    resumed_opt = OffloadOptimizer(resumed.parameters(), **HYPER, bucket_size=BUCKET)
    resumed_opt.load_state_dict(saved)
    assert resumed_opt.state_dict()["state"][0]["param_steps"] == counts
    train(resumed, resumed_opt, data[5:], 5)
    assert _same_visible(_visible(resumed, resumed_opt), _visible(straight, straight_opt))
