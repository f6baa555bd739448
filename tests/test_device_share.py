"""The device's share of the step (``device_fraction``): whatever the share, the bits of the all-host step.

The scenarios of ``test_offload_digest.py`` (accumulation over micro-batches, a layer used in some of
them only, a skipped step, clipping, lr changes, every state precision, stochastic rounding) are run
with a share drawn at random before every step, so that buckets move between host and device memory
all the time, and must give the results of the all-host run, computed in the same run (whose bits
follow the CPU: docs/numerics.md, "Across CPUs"). On this machine the device is the CPU and the
device kernel runs in Triton's interpreter; "copying" is the GPU's code path (staging areas, kept
grads in their own memory, weights spread from device buffers).
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import raw
from offload_helpers import batches, lm_loss, make_model
from test_offload_digest import (
    CONFIGS,
    DEVICES,
    HYPER,
    ZERO_CONFIGS,
    WithSide,
    _device,
    assert_same_results,
    differences,
    host_results,
    run_scenario,
)

from cpu_adam import OffloadOptimizer

triton = pytest.importorskip("triton", reason="the device kernel is written in Triton")
tl = pytest.importorskip("triton.language")

from cpu_adam import device_kernel  # noqa: E402
from cpu_adam.device_kernel import kernels, launch  # noqa: E402

HYPER_NO_LR = {k: v for k, v in HYPER.items() if k != "lr"}


def random_shares(seed: int):
    rng = random.Random(seed)
    return lambda step: rng.choice([0.0, 1.0, rng.random()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_share_drawn_at_random_every_step_gives_the_all_host_bits(name: str, device: str):
    assert_same_results(run_scenario(name, device, share=random_shares(len(name))), host_results(name))


@pytest.mark.parametrize("budget", [0, 20000], ids=["all streamed", "some resident"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp32-clip", "bf16-states-clip_grad_norm_", "bf16-sr-8bit-clip_grad_norm_"])
def test_state_streamed_beyond_the_device_budget_gives_the_all_host_bits(name: str, device: str, budget: int):
    results = run_scenario(name, device, share=random_shares(budget), device_budget=budget)
    assert_same_results(results, host_results(name))


@pytest.mark.parametrize("name", ["fp32-clip", "bf16-sr-8bit-clip_grad_norm_"])
def test_stepping_during_backward_with_a_random_share_gives_the_all_host_bits(name: str):
    shares = random_shares(2)  # 0, 1, 0.84, 1, 0, 0.61: seed 7 drew shares under 0.1, which hold no bucket
    assert_same_results(run_scenario(name, "copying", overlap="backward", share=shares), host_results(name))


@triton.jit
def _div_by_reciprocal(a, b, BEFORE_ROUNDING: tl.constexpr):
    return a * tl.math.div_rn(1.0, b)  # rounds twice


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_a_device_kernel_with_one_rounding_changed_breaks_the_contract(monkeypatch: pytest.MonkeyPatch, share: float):
    all_host = host_results("fp32-clip")
    monkeypatch.setattr(kernels, "div", _div_by_reciprocal)
    monkeypatch.setattr(launch, "_namespaces", {})
    monkeypatch.setattr(launch, "_twins", {})
    assert differences(run_scenario("fp32-clip", "cpu", share=lambda step: share), all_host)


def _state_bytes(opt: OffloadOptimizer) -> list[torch.Tensor]:
    state = opt.state_dict()
    return [raw(t) if torch.is_tensor(t) else t for g in state["state"].values() for t in g.values()]


@pytest.mark.parametrize(
    "options", [{}, {"state_precision": "8bit", "master_weights_dtype": torch.bfloat16, "stochastic_rounding": True}]
)
def test_a_state_dict_saved_under_one_share_loads_under_another(options: dict):
    data = batches(8)

    def train(model, opt, chunk) -> None:
        for tokens in chunk:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()

    straight = make_model(0)
    straight_opt = OffloadOptimizer(straight.parameters(), **HYPER, max_grad_norm=0.5, **options)
    train(straight, straight_opt, data)

    first = make_model(0)
    first_opt = OffloadOptimizer(first.parameters(), **HYPER, max_grad_norm=0.5, device_fraction=0.7, **options)
    train(first, first_opt, data[:4])
    saved = copy.deepcopy(first_opt.state_dict())
    host_only = OffloadOptimizer(make_model(0).parameters(), **HYPER, **options)
    host_only.load_state_dict(saved)
    reference = host_only.state_dict()
    assert saved.keys() == reference.keys() and saved["format"] == reference["format"]
    for g, group in saved["state"].items():  # the format: the same tensors, dtypes and shapes as a host run's
        assert {k: (v.dtype, v.shape) for k, v in group.items() if torch.is_tensor(v)} == {
            k: (v.dtype, v.shape) for k, v in reference["state"][g].items() if torch.is_tensor(v)
        }
    host_only.close()

    resumed = make_model(seed=3)
    resumed_opt = OffloadOptimizer(resumed.parameters(), lr=0.5, **HYPER_NO_LR, device_fraction=0.3, **options)
    resumed_opt.load_state_dict(saved)
    train(resumed, resumed_opt, data[4:])
    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(straight.parameters(), resumed.parameters()))
    assert all(
        torch.equal(a, b) if torch.is_tensor(a) else a == b
        for a, b in zip(_state_bytes(resumed_opt), _state_bytes(straight_opt))
    )


@pytest.mark.parametrize(
    ("options", "per_param"),
    [
        ({}, 12),
        ({"state_precision": "bf16"}, 8),
        ({"state_precision": "bf16", "master_weights_dtype": torch.bfloat16, "stochastic_rounding": True}, 4),
        ({"state_precision": "8bit", "master_weights_dtype": torch.bfloat16, "stochastic_rounding": True}, 2 + 8 / 256),
    ],
    ids=["fp32", "bf16 moments", "bf16-sr master", "bf16-sr master, 8-bit"],
)
def test_memory_stats_report_the_share_and_the_state_it_holds_on_the_device(options: dict, per_param: float):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(4)]).to(torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), bucket_size=256 * 256, device_fraction=0.5, **options)
    model(torch.randn(2, 256, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    stats = opt.memory_stats()
    assert stats["device_share"] == 0.5
    assert stats["device_state_bytes"] == per_param * 2 * 256 * 256
    assert stats["device_streamed_bytes"] == 0
    opt.device_fraction = 0.0
    opt.zero_grad()
    model(torch.randn(2, 256, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert opt.memory_stats()["device_share"] == 0.0 and opt.memory_stats()["device_state_bytes"] == 0


def test_the_share_beyond_the_budget_streams_and_memory_stats_say_how_much():
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(4)]).to(torch.bfloat16)
    bucket_state = 12 * 256 * 256  # fp32 master and moments
    opt = OffloadOptimizer(model.parameters(), bucket_size=256 * 256, device_fraction=0.75, device_budget=bucket_state)
    for _ in range(2):
        model(torch.randn(2, 256, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    stats = opt.memory_stats()
    assert stats["device_share"] == 0.75
    assert stats["device_state_bytes"] == bucket_state, "one bucket resident; the streamed ones gone after the step"
    assert stats["device_streamed_bytes"] == 2 * bucket_state


def test_a_failure_before_the_device_step_changes_nothing_and_its_retry_equals_a_twin(monkeypatch: pytest.MonkeyPatch):
    def run(fail_at: int | None) -> list:
        model = WithSide()
        opt = OffloadOptimizer(model.parameters(), **HYPER, max_grad_norm=0.05, device_fraction=0.5)
        for step, tokens in enumerate(batches(4)):
            lm_loss(model.lm, tokens).backward()
            if step == fail_at:
                before = [raw(p) for p in model.parameters()] + _state_bytes(opt)
                real = device_kernel.prepare_step

                def failing(*args, **kwargs):
                    raise RuntimeError("simulated failure on the device")

                monkeypatch.setattr(device_kernel, "prepare_step", failing)
                with pytest.raises(RuntimeError, match="simulated failure on the device"):
                    opt.step()
                monkeypatch.setattr(device_kernel, "prepare_step", real)
                after = [raw(p) for p in model.parameters()] + _state_bytes(opt)
                assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(after, before))
            opt.step()
            opt.zero_grad()
        seen = [raw(p) for p in model.parameters()] + _state_bytes(opt)
        opt.close()
        return seen

    failed, twin = run(fail_at=2), run(fail_at=None)
    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(failed, twin))


def _steps_with_a_param_missing(device: str, share: float, **options) -> list:
    """A bucket of a 256-element param (one whole 8-bit block), one that misses the second step, and one more: the
    run before the missing param ends on a block boundary inside the bucket."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16)) for n in (256, 300, 100)]
    with _device(device):
        opt = OffloadOptimizer(params, **HYPER, device_fraction=share, **options)
    seen = []
    for step in range(3):
        used = [p for i, p in enumerate(params) if not (step == 1 and i == 1)]
        sum(p.float().square().sum() * (i + 1) for i, p in enumerate(used)).backward()
        opt.step()
        opt.zero_grad()
        seen += [raw(p) for p in params]
    seen += _state_bytes(opt)
    opt.close()
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_8bit_scale_blocks_of_a_run_ending_on_a_block_boundary_inside_a_bucket(device: str):
    options = dict(state_precision="8bit", master_weights_dtype=torch.bfloat16, stochastic_rounding=True, seed=5)
    shared, host = (_steps_with_a_param_missing(device, share, **options) for share in (1.0, 0.0))
    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(shared, host))


def test_a_device_launch_that_raises_leaves_the_step_counts_of_the_buckets_it_did_not_step(
    monkeypatch: pytest.MonkeyPatch,
):
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, device_fraction=1.0)
    for tokens in batches(2):
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    before = opt.state_dict()["state"][0]["param_steps"]

    def failing(self) -> None:
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(device_kernel.Launches, "__call__", failing)
    lm_loss(model, batches(3)[2]).backward()
    with pytest.raises(RuntimeError, match="simulated launch failure"):
        opt.step()
    assert opt.state_dict()["state"][0]["param_steps"] == before == [2] * len(before)
    opt.close()


def test_a_share_set_during_a_window_applies_from_the_next():
    def run(switch: bool) -> list:
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, device_fraction=1.0 if switch else 0.0)
        for step, tokens in enumerate(batches(4)):
            lm_loss(model, tokens).backward()
            if switch:
                opt.device_fraction = [0.0, 1.0, 0.4, 0.0][step]  # grads already landed: the next window's
            opt.step()
            opt.zero_grad()
        return [raw(p) for p in model.parameters()] + _state_bytes(opt)

    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(run(True), run(False)))


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "half", True])
def test_a_device_fraction_out_of_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match="device_fraction is the share of each group's elements"):
        OffloadOptimizer(make_model(0).parameters(), device_fraction=value)


def test_without_triton_a_device_share_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(device_kernel, "missing_reason", lambda: "Triton is missing: pip install triton")
    with pytest.raises(RuntimeError, match="pip install triton"):
        OffloadOptimizer(make_model(0).parameters(), device_fraction=0.5)
    opt = OffloadOptimizer(make_model(0).parameters())
    with pytest.raises(RuntimeError, match="pip install triton"):
        opt.device_fraction = 0.5


def _zero_share_rank(rank: int, world_size: int, out: Path) -> None:
    ranks = dict(process_group=dist.group.WORLD, rank=rank, world_size=world_size)
    wrong = {}
    for name in ZERO_CONFIGS:
        all_host = run_scenario(name, "cpu", **ranks)
        for device in DEVICES:
            shared = run_scenario(name, device, share=random_shares(3), **ranks)
            wrong[f"{name}/{device}"] = differences(shared, all_host)
    torch.save(wrong, out / f"differences{rank}.pt")


@pytest.mark.dist
def test_zero_ranks_with_a_random_share_give_the_all_host_bits(tmp_path: Path):
    from rank_spawn import run_ranks

    run_ranks(_zero_share_rank, tmp_path, timeout_s=240.0)
    for rank in range(2):
        for run, wrong in torch.load(tmp_path / f"differences{rank}.pt").items():
            assert not wrong, f"rank {rank}, {run}: {len(wrong)} results differ from the all-host run's: {wrong[:6]}"


# -- device_fraction="auto" --------------------------------------------------------------------------------------

GIB = 2**30


def _layouts(buckets: int, numel: int = 2**20) -> list:
    from cpu_adam.offload.layout import FlatLayout

    return [FlatLayout([torch.Size([numel])] * buckets, numel)]


def _plan(seen, buckets: int = 10, state_per_element: int = 4):
    from cpu_adam.offload.auto import plan_share

    layouts = _layouts(buckets)
    keys = [(0, b) for b in range(buckets)]
    numel = layouts[0].pieces[0].numel
    return plan_share(layouts, dict.fromkeys(keys, state_per_element * numel), dict.fromkeys(keys, 2 * numel), seen)


def test_auto_keeps_resident_what_the_backward_left_free_and_streams_what_the_link_moves_in_the_window():
    from cpu_adam.offload.auto import LINK_USE, MEMORY_USE, Observed

    bucket = 4 * 2**20  # bytes of one bucket's state: 4 B per element
    roomy = Observed(
        total_memory=100 * GIB, busy=10 * GIB, available=90 * GIB, window_s=1.0, up_rate=1e12, down_rate=1e12
    )
    assert _plan(roomy).fraction == 1.0 and _plan(roomy).budget == 10 * bucket
    # Memory for 3 buckets beside the activations, and a link that moves 2 more in the window (each gives back its
    # grads' and weights' 2 bytes per element each way).
    total = 100 * GIB
    busy = total - int(3.5 * bucket / MEMORY_USE)
    window = (sum([2 * 2**20] * 10) + 2 * (bucket - 2 * 2**20) + 1) / (LINK_USE * 1e9)
    tight = Observed(total, busy, available=total, window_s=window, up_rate=1e9, down_rate=2e9)
    plan = _plan(tight)
    assert plan.keys == frozenset({(0, b) for b in range(5)}) and plan.budget == 3 * bucket
    # The memory at the step limits the streamed state too.
    squeezed = Observed(
        total, busy, available=int(4.5 * bucket / MEMORY_USE), window_s=window, up_rate=1e9, down_rate=2e9
    )
    assert len(_plan(squeezed).keys) == 4


def test_auto_on_the_cpu_device_leaves_the_step_to_the_host():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, device_fraction="auto")
    for tokens in batches(3):
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    assert opt.device_fraction == "auto" and opt.memory_stats()["device_share"] == 0.0


def test_auto_changing_the_share_from_step_to_step_gives_the_all_host_bits(monkeypatch: pytest.MonkeyPatch):
    from cpu_adam.offload.auto import Observed, Planner

    names = ("fp32-clip", "bf16-sr-8bit-clip_grad_norm_")
    all_host = {name: host_results(name) for name in names}  # before the planner is patched
    memory = iter([30, 3, 300, 0, 60, 12] * 10)  # KiB beside the activations, step after step
    monkeypatch.setattr(
        Planner,
        "observed",
        lambda self: Observed(2**20 + next(memory) * 1024, 2**20, 2**30, window_s=1.0, up_rate=1e4, down_rate=1e4),
    )
    seen = []
    real = Planner.step_ended

    def noting(self, now: float) -> None:
        real(self, now)
        seen.append(len(self._share._requested or ()))

    monkeypatch.setattr(Planner, "step_ended", noting)
    for name in names:
        assert_same_results(run_scenario(name, "copying", device_fraction="auto"), all_host[name])
    assert len(set(seen)) > 2, f"the share changed from step to step: {seen}"


def _auto_rank(rank: int, world_size: int, out: Path) -> None:
    from cpu_adam.offload import auto

    # Rank 0 sees room beside the activations for the state of fewer buckets than rank 1.
    room = [30, 300][rank] * 1024
    observed = auto.Observed(2**20 + room, 2**20, 2**30, window_s=1.0, up_rate=1e4, down_rate=1e4)
    auto.Planner.observed = lambda self: observed
    planned = []
    real_plan = auto.plan_share

    def noting(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        planned.append(len(plan.keys))
        return plan

    auto.plan_share = noting
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, process_group=dist.group.WORLD, device_fraction="auto")
    for tokens in batches(2, batch=4 * world_size):
        lm_loss(model, tokens.chunk(world_size)[rank]).backward()
        opt.step()
        opt.zero_grad()
    torch.save({"planned": planned[-1], "taken": sorted(opt._rooms.share.keys)}, out / f"auto{rank}.pt")
    opt.close()


@pytest.mark.dist
def test_auto_takes_the_share_every_rank_can_hold(tmp_path: Path):
    from rank_spawn import run_ranks

    run_ranks(_auto_rank, tmp_path, timeout_s=120.0)
    ranks = [torch.load(tmp_path / f"auto{r}.pt") for r in range(2)]
    planned = [r["planned"] for r in ranks]
    assert planned[0] < planned[1], f"the ranks' plans must differ for the test to mean anything: {planned}"
    assert ranks[0]["taken"] == ranks[1]["taken"] and len(ranks[0]["taken"]) == min(planned)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
@pytest.mark.parametrize("budget", [None, 0], ids=["resident", "streamed"])
@pytest.mark.parametrize("name", ["fp32-clip", "bf16-sr-8bit-clip_grad_norm_"])
def test_on_cuda_a_random_share_gives_the_all_host_bits(name: str, budget: int | None):
    def run(share) -> list:
        options = dict(CONFIGS[name])
        clip = options.pop("clip", None)
        model = make_model(0, "cuda")
        opt = OffloadOptimizer(model.parameters(), **HYPER, device_budget=budget, **options)
        seen = []
        for step, tokens in enumerate(batches(6, device="cuda")):
            opt.device_fraction = share(step)
            lm_loss(model, tokens).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            seen += [raw(p).cpu() for p in model.parameters()] + [opt.last_grad_norm]
        seen += [raw(t) if torch.is_tensor(t) else t for g in opt.state_dict()["state"].values() for t in g.values()]
        opt.close()
        return seen

    shared, host = run(random_shares(11)), run(lambda step: 0.0)
    assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(shared, host))
