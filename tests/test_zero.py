"""OffloadOptimizer with a process group (ZeRO): 2 gloo ranks on the CPU against one process.

The ranks run in spawned processes (``rank_spawn.run_ranks``: a failing rank fails the test,
collectives and the whole run time out) and save what they hold to ``tmp_path``; the checks run
here. Each spawn trains several variants, so a test costs one process start-up, not several.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from offload_helpers import VOCAB, CopyingCPU, batches, lm_loss, make_model, reentrant_checkpointed_loss
from rank_spawn import run_ranks
from torch import nn

from cpu_adam import OffloadOptimizer, offload
from cpu_adam import _threads as thread_share
from cpu_adam.distributed import consolidate_state_dict
from cpu_adam.offload.layout import ALIGN, FlatLayout, canonical_offsets, full_to_shard, shards_to_full
from cpu_adam.quant8 import BLOCK

pytestmark = pytest.mark.dist

BUCKET = 1024  # elements: the tiny model spans several buckets, so ranks own pieces of each
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, bucket_size=BUCKET)
STEPS = 8
BATCH = 8  # the global batch: each of the 2 ranks gets half
SPAWN_TIMEOUT_S = 60.0
PRECISIONS = {"fp32": {}, "8bit": {"state_precision": "8bit"}}  # checkpoints: float states, and 8-bit codes + scales


def _train(model: nn.Module, opt: OffloadOptimizer, data: list[torch.Tensor]) -> list[float]:
    norms = []
    for tokens in data:
        lm_loss(model, tokens).backward()
        opt.step()
        norms.append(opt.last_grad_norm)
    return norms


def _snapshot(model: nn.Module, opt: OffloadOptimizer, **extra: Any) -> dict[str, Any]:
    return {
        "state": opt.state_dict(),
        "weights": [p.detach().clone() for p in model.parameters()],
        "memory": opt.memory_stats(),
        "threads": torch.get_num_threads(),
        **extra,
    }


def _zero_opt(model: nn.Module, **options: Any) -> OffloadOptimizer:
    return OffloadOptimizer(model.parameters(), **HYPER, process_group=dist.group.WORLD, **options)


_CPU = offload.rooms.DeviceOps


# -- rank functions (run in the spawned processes) ------------------------------------------


def _parity_rank(rank: int, world_size: int, out: Path) -> None:
    data = batches(STEPS, batch=BATCH)
    halves = [tokens.chunk(world_size)[rank] for tokens in data]

    # "global": each rank its half of the global batch, clipped every step.
    model = make_model(0)
    opt = _zero_opt(model, max_grad_norm=0.5)
    norms = _train(model, opt, halves)
    torch.save(_snapshot(model, opt, norms=norms), out / f"global{rank}.pt")

    # "clip": as "global", clipped by torch.nn.utils.clip_grad_norm_ on the model (as frameworks do).
    model = make_model(0)
    opt = _zero_opt(model)
    norms = []
    for tokens in halves:
        lm_loss(model, tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
    torch.save(_snapshot(model, opt, norms=norms), out / f"clip{rank}.pt")

    # "fallback": the same through all-reduce + slice instead of reduce-scatter.
    model = make_model(0)
    opt = _zero_opt(model, max_grad_norm=0.5)
    opt._rooms.world.native_reduce_scatter = False
    _train(model, opt, halves)
    torch.save(_snapshot(model, opt), out / f"fallback{rank}.pt")

    # "copying": the GPU code path (staging areas, reduced pieces copied down, weights uploaded
    # into their place and all-gathered in place), with the CPU standing in for the device.
    offload.rooms.DeviceOps = CopyingCPU
    model = make_model(0)
    opt = _zero_opt(model, max_grad_norm=0.5)
    offload.rooms.DeviceOps = _CPU
    _train(model, opt, halves)
    torch.save(_snapshot(model, opt), out / f"copying{rank}.pt")

    # "same": every rank the same half batch, no clipping: the mean over ranks is exact.
    model = make_model(0)
    opt = _zero_opt(model)
    norms = _train(model, opt, [tokens.chunk(world_size)[0] for tokens in data])
    torch.save(_snapshot(model, opt, norms=norms), out / f"same{rank}.pt")

    # "limit-*": a max_grad_norm the grads stay under must change nothing, serial or overlapped.
    for overlap in ("none", "backward"):
        for limit in (None, 1e6):
            model = make_model(0)
            opt = _zero_opt(model, max_grad_norm=limit, overlap=overlap)
            norms = _train(model, opt, halves[:4])
            torch.save(_snapshot(model, opt, norms=norms), out / f"limit-{overlap}-{limit}{rank}.pt")
            opt.close()

    linear = nn.Linear(256, 256, bias=False).to(torch.bfloat16)  # one aligned bucket: no padding
    stats = OffloadOptimizer(linear.parameters(), process_group=dist.group.WORLD).memory_stats()
    torch.save(stats, out / f"linear{rank}.pt")


def _resume_rank(rank: int, world_size: int, out: Path) -> None:
    for tag, options in PRECISIONS.items():
        _resume_one(rank, world_size, out / tag, options)


def _resume_one(rank: int, world_size: int, out: Path, options: dict[str, Any]) -> None:
    # Every rank trains on the same batches, so 2 ranks do the math of 1 process bit for bit.
    out.mkdir(exist_ok=True)
    data = batches(STEPS, batch=BATCH // 2)
    half = STEPS // 2

    model = make_model(0)
    opt = _zero_opt(model, **options)
    _train(model, opt, data)
    torch.save(_snapshot(model, opt), out / f"straight{rank}.pt")

    model = make_model(0)
    opt = _zero_opt(model, **options)
    _train(model, opt, data[:half])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out / f"half{rank}.pt")
    dist.barrier()

    own = torch.load(out / f"half{rank}.pt")
    model = make_model(seed=123)  # everything must come from the checkpoint
    model.load_state_dict(own["model"])
    opt = OffloadOptimizer(model.parameters(), lr=0.5, bucket_size=BUCKET, process_group=dist.group.WORLD, **options)
    opt.load_state_dict(own["opt"])
    _train(model, opt, data[half:])
    torch.save(_snapshot(model, opt), out / f"own{rank}.pt")

    full = consolidate_state_dict([torch.load(out / f"half{r}.pt")["opt"] for r in range(world_size)])
    model = make_model(seed=123)
    opt = OffloadOptimizer(model.parameters(), lr=0.5, bucket_size=BUCKET, process_group=dist.group.WORLD, **options)
    opt.load_state_dict(full)  # the optimizer alone sets the device weights
    _train(model, opt, data[half:])
    torch.save(_snapshot(model, opt), out / f"full{rank}.pt")

    other = torch.load(out / f"half{1 - rank}.pt")["opt"]
    with pytest.raises(ValueError, match=rf"rank {1 - rank} of 2 .* this optimizer is rank {rank} of 2"):
        opt.load_state_dict(other)


def _mlp_scaled_loss(model: nn.Module, tokens: torch.Tensor, mlp: float | None) -> torch.Tensor:
    """lm_loss with the MLP block's output times ``mlp``; None leaves the block out of the graph."""
    x = model.emb(tokens[:, :-1])
    if mlp is not None:
        x = x + mlp * model.fc2(torch.nn.functional.gelu(model.fc1(model.ln1(x))))
    logits = model.head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _robustness_rank(rank: int, world_size: int, out: Path) -> None:
    # Ranks built from different seeds train rank 0's weights, and draw rank 0's random bits.
    model = make_model(seed=rank)
    opt = _zero_opt(model, state_precision="8bit", seed=100 + rank)
    torch.save([p.detach().clone() for p in model.parameters()], out / f"init{rank}.pt")
    seeds = [opt.seed]
    shard = opt.state_dict()
    shard["seed"] = 200 + rank  # as shards saved by 0.2 with stochastic rounding may hold
    opt.load_state_dict(shard)
    torch.save([*seeds, opt.seed], out / f"seed{rank}.pt")

    # The same, handed over from fp32 CPU models: rank 0's fp32 values become every rank's masters.
    model = make_model(seed=rank, dtype=torch.float32)
    opt = _zero_opt(model, device="cpu")
    torch.save(
        _snapshot(model, opt, master=opt._rooms.store.master(0, slice(None)).clone()), out / f"handover{rank}.pt"
    )

    # Graphs that differ: rank 1 leaves the MLP out, or multiplies it by 0 (the same zero grads,
    # sent in another order). No hang, no error, the same bits.
    data = batches(4)
    for variant, mlp in (("unused", None), ("zeroed", 0.0)):
        model = make_model(0)
        opt = _zero_opt(model)
        for tokens in data:
            _mlp_scaled_loss(model, tokens, 1.0 if rank == 0 else mlp).backward()
            opt.step()
        torch.save(_snapshot(model, opt), out / f"{variant}{rank}.pt")

    # The MLP misses the first step on every rank: its params keep their own step counts.
    model = make_model(0)
    opt = _zero_opt(model)
    for n, tokens in enumerate(data):
        _mlp_scaled_loss(model, tokens, None if n == 0 else 1.0).backward()
        opt.step()
    torch.save(opt.state_dict(), out / f"late{rank}.pt")

    # Two param groups, weights and biases, as recipes split them: after the first backward the
    # buckets are reduced in the order they fill, so the device holds a few buckets, not all.
    offload.rooms.DeviceOps = CopyingCPU
    layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)]).to(torch.bfloat16)
    weights = [m.weight for m in layers]
    biases = [m.bias for m in layers]
    opt = OffloadOptimizer([{"params": weights}, {"params": biases}], bucket_size=1024, process_group=dist.group.WORLD)
    offload.rooms.DeviceOps = _CPU
    peaks = []
    for _ in range(3):
        opt._rooms.dev.peak_bytes = 0
        layers(torch.randn(4, 32, dtype=torch.bfloat16)).float().sum().backward()
        peaks.append(opt._rooms.dev.peak_bytes)
        opt.step()
    torch.save(peaks, out / f"peaks{rank}.pt")

    # A param used in two reentrant-checkpointed segments: a clear error on every rank, no hang.
    model = make_model(0)
    opt = _zero_opt(model)
    with pytest.raises(RuntimeError, match=r"use_reentrant=False"):
        reentrant_checkpointed_loss(model, data[0]).backward()


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parity")
    run_ranks(_parity_rank, out, world_size=2, timeout_s=SPAWN_TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume")
    run_ranks(_resume_rank, out, world_size=2, timeout_s=SPAWN_TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def robustness_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("robustness")
    run_ranks(_robustness_rank, out, world_size=2, timeout_s=SPAWN_TIMEOUT_S)
    return out


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A gloo group of one process, in this process: the ZeRO code path without spawning."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _load(out: Path, name: str) -> list[dict[str, Any]]:
    """What both ranks saved as ``name`` (a path relative to ``out``)."""
    return [torch.load(out / f"{name}{r}.pt") for r in range(2)]


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """The ranks' thread count: bf16 matmuls round differently with another (their sums split otherwise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="cpu_adam: the optimizer step runs on 1 thread")
            yield
    finally:
        torch.set_num_threads(threads)


def _single(data: list[torch.Tensor], threads: int, **options: Any) -> tuple[nn.Module, OffloadOptimizer, list[float]]:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, **options)
    with _threads(threads):
        return model, opt, _train(model, opt, data)


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    for g, group in a["state"].items():
        assert group["step"] == b["state"][g]["step"]
        assert group.keys() == b["state"][g].keys()
        for name in ("master", "exp_avg", "exp_avg_sq", "state_scales"):
            if name in group:
                assert torch.equal(group[name], b["state"][g][name]), f"group {g}: {name} differs"


# -- two ranks against one process ------------------------------------------------------------


def test_two_ranks_match_one_process_on_the_global_batch(parity_run: Path):
    ranks = _load(parity_run, "global")
    _, opt, norms = _single(batches(STEPS, batch=BATCH), ranks[0]["threads"], max_grad_norm=0.5)
    full = consolidate_state_dict([r["state"] for r in ranks])
    mine, ref = full["state"][0]["master"], opt.state_dict()["state"][0]["master"]
    # The grads differ by bf16 rounding: the ranks' half-batch grads are bf16 and their sum is
    # rounded to bf16 again by the reduce-scatter (2^-9 relative), while the single process
    # differentiates the whole batch in bf16. Adam is invariant to the grads' scale, so a relative
    # grad error d moves an update by ~d * lr: after T steps ~T * lr * 2^-8, allowing 4x that.
    # Only grads at rounding level can flip sign and move by up to ~2 lr per step; a wrong piece,
    # a missed reduction or a doubled step moves thousands of masters by far more.
    diff = (mine - ref).abs()
    close = int((diff <= STEPS * HYPER["lr"] * 2**-6).sum())
    assert close >= 0.99 * diff.numel(), f"only {close} of {diff.numel()} masters agree with one process"
    assert diff.max() <= 2 * STEPS * HYPER["lr"]
    # The reported norm is that of the averaged grads (summed grads would give twice as much).
    for zero_norm, single_norm in zip(ranks[0]["norms"], norms):
        assert zero_norm == pytest.approx(single_norm, rel=2**-6)
    assert ranks[0]["norms"] == ranks[1]["norms"]


@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_a_max_grad_norm_the_grads_stay_under_changes_nothing(parity_run: Path, overlap: str):
    for unlimited, limited in zip(
        _load(parity_run, f"limit-{overlap}-None"), _load(parity_run, f"limit-{overlap}-1000000.0")
    ):
        assert limited["norms"] == unlimited["norms"] and max(limited["norms"]) < 1e6
        assert all(torch.equal(a, b) for a, b in zip(limited["weights"], unlimited["weights"]))
        _assert_same_state(limited["state"], unlimited["state"])
        assert limited["state"]["state"][0]["param_steps"] == unlimited["state"]["state"][0]["param_steps"]


def test_the_mean_over_ranks_is_exact_when_the_ranks_see_the_same_batch(parity_run: Path):
    # Both ranks get the same half batch: the reduce-scatter sums g + g = 2g exactly in bf16 and
    # the grad scale's 1/2 makes it g again, so the run is the single process's, bit for bit.
    ranks = _load(parity_run, "same")
    model, opt, norms = _single([tokens.chunk(2)[0] for tokens in batches(STEPS, batch=BATCH)], ranks[0]["threads"])
    _assert_same_state(consolidate_state_dict([r["state"] for r in ranks]), opt.state_dict())
    for rank in ranks:
        assert all(torch.equal(a, b) for a, b in zip(rank["weights"], model.parameters()))
    assert ranks[0]["norms"] == pytest.approx(norms, rel=1e-6)  # summed in another order


def test_ranks_hold_identical_device_weights(parity_run: Path):
    ranks = _load(parity_run, "global")
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]))
    # ... which are the consolidated masters rounded to bf16.
    full = consolidate_state_dict([r["state"] for r in ranks])
    model = make_model(seed=9)
    OffloadOptimizer(model.parameters(), **HYPER).load_state_dict(full)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["weights"], model.parameters()))


def test_clip_grad_norm_on_the_model_clips_every_rank_alike(parity_run: Path):
    # The norm is of the averaged grads, the same on every rank; the clipping is the optimizer's own.
    clip, own = _load(parity_run, "clip"), _load(parity_run, "global")
    assert clip[0]["norms"] == clip[1]["norms"]
    assert clip[0]["norms"] == pytest.approx(own[0]["norms"], rel=1e-5)
    assert min(clip[0]["norms"]) > 2 * 0.5  # every step was clipped
    for a, b in zip(clip, own):
        mine, ref = a["state"]["state"][0]["master"], b["state"]["state"][0]["master"]
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-6)


def test_a_model_handed_over_from_the_cpu_takes_rank_0s_fp32_values(robustness_run: Path):
    ranks = _load(robustness_run, "handover")
    # Before the first step the state dicts hold no tensors: the shards as the host holds them.
    shards = [{**r["state"], "state": {0: {**r["state"]["state"][0], "master": r["master"]}}} for r in ranks]
    master = consolidate_state_dict(shards)["state"][0]["master"]
    rank0 = list(make_model(seed=0, dtype=torch.float32).parameters())
    for p, start in zip(rank0, canonical_offsets([p.shape for p in rank0])):
        assert torch.equal(master[start : start + p.numel()], p.detach().reshape(-1))
    for rank in ranks:
        assert all(torch.equal(a, p.detach().to(torch.bfloat16)) for a, p in zip(rank["weights"], rank0))


@pytest.mark.parametrize("variant", ["fallback", "copying"])
def test_other_code_paths_give_the_same_result(parity_run: Path, variant: str):
    # fallback: all-reduce + slice instead of reduce-scatter; copying: the GPU path on the CPU.
    for a, b in zip(_load(parity_run, "global"), _load(parity_run, variant)):
        _assert_same_state(a["state"], b["state"])
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
    if variant == "copying":
        stats = _load(parity_run, variant)[0]["memory"]
        assert stats["device_bytes"] == 0 and stats["device_peak_bytes"] > 0


def test_host_bytes_per_rank_are_halved(parity_run: Path):
    for stats in _load(parity_run, "linear"):
        assert stats["world_size"] == 2
        assert stats["host_bytes"] == 14 * 256 * 256 // 2
        assert stats["host_bytes_per_param"] == 7
    single = OffloadOptimizer(make_model(0).parameters(), **HYPER).memory_stats()
    for rank in _load(parity_run, "global"):
        stats = rank["memory"]
        buckets = 7  # the tiny model's bucket count at BUCKET: each may gain up to ALIGN padding elements
        assert single["host_bytes"] / 2 <= stats["host_bytes"] <= single["host_bytes"] / 2 + buckets * ALIGN * 14


# -- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("tag", PRECISIONS)
def test_resume_on_two_ranks_is_bit_exact(resume_run: Path, tag: str):
    straight = consolidate_state_dict([r["state"] for r in _load(resume_run, f"{tag}/straight")])
    for name in ("own", "full"):  # each rank's own shard; the consolidated full dict, resharded
        ranks = _load(resume_run, f"{tag}/{name}")
        _assert_same_state(consolidate_state_dict([r["state"] for r in ranks]), straight)
        for rank, reference in zip(ranks, _load(resume_run, f"{tag}/straight")):
            assert all(torch.equal(a, b) for a, b in zip(rank["weights"], reference["weights"]))


@pytest.mark.parametrize("tag", PRECISIONS)
def test_two_rank_checkpoint_resumes_on_one_process(resume_run: Path, tag: str):
    data = batches(STEPS, batch=BATCH // 2)
    full = consolidate_state_dict([torch.load(resume_run / tag / f"half{r}.pt")["opt"] for r in range(2)])
    model = make_model(seed=123)
    # Another bucket size: full dicts allow it.
    opt = OffloadOptimizer(model.parameters(), lr=0.5, bucket_size=4096, **PRECISIONS[tag])
    opt.load_state_dict(full)
    straight = _load(resume_run, f"{tag}/straight")
    with _threads(straight[0]["threads"]):
        _train(model, opt, data[STEPS // 2 :])
    _assert_same_state(opt.state_dict(), consolidate_state_dict([r["state"] for r in straight]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight[0]["weights"]))


# -- one rank in this process: the ZeRO code path, errors, threads ---------------------------------


def test_ranks_built_from_other_seeds_train_rank_0s_weights(robustness_run: Path):
    rank0 = [p.detach() for p in make_model(seed=0).parameters()]
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(torch.load(robustness_run / f"init{r}.pt"), rank0))
        assert torch.load(robustness_run / f"seed{r}.pt") == [100, 200]  # rank 0's stream of random bits


def test_ranks_whose_graphs_differ_reduce_in_one_order(robustness_run: Path):
    # Rank 1 has no grad for the MLP: its zeros join the average, as with DDP, in the same order.
    for unused, zeroed in zip(_load(robustness_run, "unused"), _load(robustness_run, "zeroed")):
        _assert_same_state(unused["state"], zeroed["state"])
        assert all(torch.equal(a, b) for a, b in zip(unused["weights"], zeroed["weights"]))
    first = make_model(0)
    weights = _load(robustness_run, "unused")[0]["weights"]
    assert not torch.equal(weights[list(dict(first.named_parameters())).index("fc1.weight")], first.fc1.weight)


def test_consolidation_keeps_each_params_step_count(robustness_run: Path):
    shards = _load(robustness_run, "late")
    full = consolidate_state_dict(shards)
    steps = full["state"][0]["param_steps"]
    names = list(dict(make_model(0).named_parameters()))
    mlp = {i for i, name in enumerate(names) if name.split(".")[0] in ("ln1", "fc1", "fc2")}
    assert [steps[i] for i in sorted(mlp)] == [3] * len(mlp)
    assert all(steps[i] == 4 for i in range(len(steps)) if i not in mlp)
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    opt.load_state_dict(full)
    assert opt._rooms.store.steps[0] == steps


def test_zero_device_memory_after_the_first_backward_is_a_few_buckets(robustness_run: Path):
    bucket_bytes = 1024 * 2
    for first, *later in _load(robustness_run, "peaks"):
        # The first backward reduces the last bucket first: the bias group's, which fills last.
        assert first > 5 * bucket_bytes
        assert all(peak <= 5 * bucket_bytes for peak in later), f"{later} bytes held"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_layout_and_resharding_round_trip(world_size: int):
    shapes = [p.shape for p in make_model(0).parameters()]
    one = FlatLayout(shapes, BUCKET)
    full = torch.zeros(one.numel)
    for i in range(len(shapes)):  # distinct values in the params, zeros in the padding
        lo, hi = one.param_range(i)
        full[lo:hi] = torch.arange(lo, hi) + 1.0
    layouts = [FlatLayout(shapes, BUCKET, world_size=world_size, rank=r) for r in range(world_size)]
    for layout in layouts:
        assert [(b.first, b.last) for b in layout.buckets] == [(b.first, b.last) for b in one.buckets]
        assert all(
            p.numel * world_size == b.numel and p.numel % ALIGN == 0 for p, b in zip(layout.pieces, layout.buckets)
        )
    shards = [full_to_shard(full, layout) for layout in layouts]
    assert sum(s.numel() for s in shards) == layouts[0].numel < one.numel + len(one.buckets) * ALIGN * world_size
    assert torch.equal(shards_to_full(shards, layouts), full)
    assert sorted(torch.cat(shards)[torch.cat(shards) > 0].tolist()) == full[full > 0].tolist()
    # Block tensors (8-bit states' scales, [2, blocks]) follow their elements: a block's entry goes
    # to the rank holding the block's elements.
    block_values = full.view(-1, BLOCK)[:, :1].T.repeat(2, 1) * torch.tensor([[1.0], [-1.0]])
    block_shards = [full_to_shard(block_values, layout, per=BLOCK) for layout in layouts]
    for shard, block_shard in zip(shards, block_shards):
        firsts = shard.view(-1, BLOCK)[:, 0]
        assert torch.equal(block_shard, torch.stack([firsts, -firsts]))
    assert torch.equal(shards_to_full(block_shards, layouts, per=BLOCK), block_values)


def test_one_rank_group_is_the_plain_optimizer_bit_for_bit(one_rank_group):
    plain, zero = make_model(0), make_model(0)
    plain_opt = OffloadOptimizer(plain.parameters(), **HYPER, max_grad_norm=0.5)
    zero_opt = OffloadOptimizer(zero.parameters(), **HYPER, max_grad_norm=0.5, process_group=one_rank_group)
    for i, tokens in enumerate(batches(4)):
        for model, opt in ((plain, plain_opt), (zero, zero_opt)):
            for chunk in tokens.chunk(2 if i % 2 else 1):  # with and without accumulation
                lm_loss(model, chunk).backward()
            opt.step()
        assert zero_opt.last_grad_norm == plain_opt.last_grad_norm
    _assert_same_state(zero_opt.state_dict(), plain_opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(zero.parameters(), plain.parameters()))


def test_a_shard_of_another_layout_is_refused_with_the_fix(one_rank_group):
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, process_group=one_rank_group)
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    shard = opt.state_dict()
    for zero, mismatch in (
        ({"rank": 1, "world_size": 2, "bucket_size": BUCKET}, "rank 1 of 2"),
        ({"rank": 0, "world_size": 1, "bucket_size": 2 * BUCKET}, f"bucket_size {2 * BUCKET}"),
    ):
        with pytest.raises(ValueError, match=rf"{mismatch}.*consolidate_state_dict"):
            opt.load_state_dict({**shard, "zero": zero})
    plain = OffloadOptimizer(make_model(0).parameters(), **HYPER)
    with pytest.raises(ValueError, match=r"rank 0 of 1 .* this optimizer is rank 0 of 1 \(bucket_size"):
        plain.load_state_dict({**shard, "zero": {"rank": 0, "world_size": 1, "bucket_size": 1}})
    with pytest.raises(ValueError, match=r"ranks given are \[0\]"):
        consolidate_state_dict([{**shard, "zero": {"rank": 0, "world_size": 2, "bucket_size": BUCKET}}])
    with pytest.raises(ValueError, match="already a full state dict"):
        consolidate_state_dict([plain.state_dict()])


def test_a_destroyed_process_group_gives_a_clear_error(one_rank_group):
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, process_group=one_rank_group)
    dist.destroy_process_group()  # collectives on it would silently do nothing
    with pytest.raises(RuntimeError, match="destroyed"):
        lm_loss(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="destroyed"):
        opt.step()
    with pytest.raises(RuntimeError, match="destroyed"):
        OffloadOptimizer(make_model(0).parameters(), process_group=one_rank_group)
    with pytest.raises(TypeError, match="ProcessGroup"):
        OffloadOptimizer(make_model(0).parameters(), process_group=object())


def test_threads_are_logged_and_one_thread_warns_with_the_fix(
    one_rank_group, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    monkeypatch.setattr(thread_share, "usable_cores", lambda: 8)
    monkeypatch.setattr(thread_share, "_warned", False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with pytest.warns(UserWarning, match=r"torch\.set_num_threads\(4\)"):
            OffloadOptimizer(make_model(0).parameters(), process_group=one_rank_group)
        torch.set_num_threads(4)
        with caplog.at_level(logging.INFO, logger="cpu_adam"), warnings.catch_warnings():
            warnings.simplefilter("error")  # the right thread count: no warning
            OffloadOptimizer(make_model(0).parameters(), process_group=one_rank_group)
    finally:
        torch.set_num_threads(threads)
    assert "rank 0 of 1 steps on 4 CPU threads (its share of the cores: 4)" in caplog.text
