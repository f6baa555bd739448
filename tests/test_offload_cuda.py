"""OffloadOptimizer on a CUDA device: parity, bounded device memory, stream ordering."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from offload_helpers import (
    AdamWOracle,
    FailingBackward,
    GradTap,
    assert_matches_oracle,
    batches,
    lm_loss,
    loss_failing_midway,
    make_model,
    reentrant_checkpointed_loss,
)
from torch import nn

from cpu_adam.offload import OffloadOptimizer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
SLEEP_CYCLES = 50_000_000  # ~25-35 ms of one spinning kernel: far longer than any copy here


def build(max_norm: float | None = None):
    model = make_model(0, device="cuda")
    params = list(model.parameters())
    tap = GradTap(params)
    opt = OffloadOptimizer(params, **HYPER, max_grad_norm=max_norm, bucket_size=1024)
    oracle = AdamWOracle([{"params": params}], **HYPER)
    return model, params, tap, opt, oracle


def test_pinned_buffer_is_page_locked_at_exact_size():
    _, _, _, opt, _ = build()
    stats = opt.memory_stats()
    assert stats["pinned"]
    assert opt._rooms.link.buffers[0].tensor.is_pinned()
    assert stats["pinned_bytes"] == 2 * opt._rooms.layouts[0].numel


def test_parity_with_torch_adamw_on_cuda():
    model, params, tap, opt, oracle = build(max_norm=0.5)
    for tokens in batches(24, device="cuda"):
        lm_loss(model, tokens).backward()
        norm = oracle.step(tap.take(), max_norm=0.5)
        opt.step()
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-4)
        assert_matches_oracle(opt, params, oracle)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_clip_grad_norm_on_the_model_clips_for_real_on_cuda(micro_batches: int):
    # Per-param norms taken on the side stream; the framework's coefficient folded into the step.
    model, params, tap, opt, oracle = build()
    data = batches(4 * micro_batches, device="cuda")
    for step in range(4):
        for tokens in data[step * micro_batches : (step + 1) * micro_batches]:
            lm_loss(model, tokens).backward()
        grads = tap.take()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        expected = oracle.step(grads, max_norm=0.05)
        assert norm == pytest.approx(expected, rel=1e-4) and expected > 0.1
        opt.step()
        assert_matches_oracle(opt, params, oracle)
        model.zero_grad()


def test_accumulation_on_cuda():
    model, params, tap, opt, oracle = build()
    for tokens in batches(3, batch=16, device="cuda"):
        for chunk in tokens.chunk(4):
            (lm_loss(model, chunk) / 4).backward()
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, params, oracle)


def _slow_side_stream_copies(opt: OffloadOptimizer) -> None:
    """Every copy the optimizer makes on its side stream first waits behind a long kernel."""
    copy = opt._rooms.dev.copy

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        torch.cuda._sleep(SLEEP_CYCLES)  # queued on the current stream: the side stream here
        copy(dst, src)

    opt._rooms.dev.copy = slow_copy


def test_stream_ordering_survives_slow_copies():
    """Fails if a staging area is reused before its copy down ran, or if the forward after
    step() reads the weights before their upload landed."""
    model, params, tap, opt, oracle = build()
    _slow_side_stream_copies(opt)
    data = batches(4, device="cuda")
    probe = data[3]
    for tokens in data[:3]:
        torch.cuda._sleep(SLEEP_CYCLES)  # backward (and the grad packing) starts late
        lm_loss(model, tokens).backward()
        # Tiny kernels at once, in memory just freed: they would overwrite a staging area
        # released before its copy down ran.
        junk = [torch.full((4096,), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(64)]
        del junk
        oracle.step(tap.take())
        opt.step()
        with torch.no_grad():
            early = model(probe)  # queued at once: must run on the uploaded weights
            torch.cuda.synchronize()
            late = model(probe)
        assert torch.equal(early, late), "a forward right after step() saw weights still being uploaded"
        assert_matches_oracle(opt, params, oracle)


def test_reads_right_after_step_see_the_new_weights():
    model, params, _, opt, _ = build()
    _slow_side_stream_copies(opt)
    lm_loss(model, batches(1, device="cuda")[0]).backward()
    before = [p.detach().clone() for p in params]
    opt.step()
    snapshot = [p.detach().clone() for p in params]  # on the compute stream, no host sync first
    torch.cuda.synchronize()
    for p, s in zip(params, snapshot):
        assert torch.equal(p.detach(), s), "a read right after step() saw weights still being uploaded"
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, params))


def test_device_memory_for_grads_stays_bounded():
    layers, width = 32, 2048
    bucket = width * width
    weight_bytes = layers * bucket * 2

    def mlp() -> nn.Module:
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to("cuda", torch.bfloat16)

    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)

    def extra_during_backward(model: nn.Module) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model(x).float().sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    plain = mlp()
    assert extra_during_backward(plain) >= weight_bytes  # without the optimizer every grad stays
    del plain
    torch.cuda.empty_cache()

    model = mlp()
    opt = OffloadOptimizer(model.parameters(), bucket_size=bucket, max_inflight_buckets=2)
    extra = extra_during_backward(model)
    # One grad being packed, the open bucket and two in flight (bf16), one fp32 norm temporary,
    # and slack for activations and library workspaces.
    bound = 4 * bucket * 2 + bucket * 4 + 16 * 2**20
    assert extra <= bound < weight_bytes / 2, f"{extra / 2**20:.0f} MiB held during backward"
    assert opt.memory_stats()["device_peak_bytes"] <= 3 * bucket * 2
    opt.step()
    assert opt.memory_stats()["device_bytes"] == 0


# -- stress shapes and stream races -----------------------------------------------------------------

FAST_SLEEP_CYCLES = 10_000_000  # ~5-7 ms: still far longer than any copy of the tiny model


def _low_density_run(sync_every_step: bool, steps: int = 12) -> list[torch.Tensor]:
    """torchao's stress shape: a wide Linear whose weights take far longer to copy than to use."""
    torch.manual_seed(0)
    model = nn.Linear(32, 131072).to("cuda", torch.bfloat16)
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, bucket_size=2**20)  # several buckets and chunks
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(16, 32, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(steps)]
    for x in xs:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        if sync_every_step:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.master_weights()]


def test_back_to_back_low_density_loop_equals_synchronized_loop():
    fast, synced = _low_density_run(False), _low_density_run(True)
    for a, b in zip(fast, synced):
        assert torch.equal(a, b), "without host syncs a step read weights or grads still in flight"


def _slow_compute_at_packing(params: list[torch.Tensor]) -> list:
    """Queues a long kernel on the compute stream just before the optimizer packs each grad.

    Registered after the tap and before the optimizer, so it runs between them: a copy down
    that does not wait for the compute stream reads the staging area before the grad is in it.
    """
    return [p.register_post_accumulate_grad_hook(lambda p: torch.cuda._sleep(FAST_SLEEP_CYCLES)) for p in params]


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_copies_down_wait_for_a_slow_compute_stream(micro_batches: int):
    model = make_model(0, device="cuda")
    params = list(model.parameters())
    tap = GradTap(params)
    _slow_compute_at_packing(params)
    opt = OffloadOptimizer(params, **HYPER, bucket_size=1024)
    oracle = AdamWOracle([{"params": params}], **HYPER)
    for tokens in batches(3, batch=12, device="cuda"):
        for chunk in tokens.chunk(micro_batches):
            (lm_loss(model, chunk) / micro_batches).backward()
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, params, oracle)


# -- device memory: the weights plus a bounded number of buckets ------------------------------------

WIDTH, LAYERS = 2048, 16
LAYER_BYTES = WIDTH * WIDTH * 2


def _mlp(used: int = LAYERS) -> nn.Module:
    layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    layers.used = used  # the forward runs the first `used` layers only

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in list(layers)[: layers.used]:
            x = layer(x)
        return x

    layers.forward = forward
    return layers.to("cuda", torch.bfloat16)


def _extra_peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


# The promise: besides the weights, the optimizer holds at most the packed bucket, the
# in-flight ones and their norm temporaries, plus one grad being packed and the activations.
def _bound(bucket_bytes: int, inflight: int = 2) -> int:
    return (inflight + 2) * bucket_bytes + bucket_bytes * 2 + 16 * 2**20


def test_construction_holds_no_second_copy_of_the_weights():
    model = _mlp()
    weights = sum(p.numel() * 2 for p in model.parameters())
    extra = _extra_peak(lambda: OffloadOptimizer(model.parameters(), bucket_size=WIDTH * WIDTH))
    assert extra <= _bound(LAYER_BYTES) < weights, f"{extra / 2**20:.0f} MiB extra while building the optimizer"


def _backward_extra(model: nn.Module, params: list[torch.Tensor], **options) -> int:
    opt = OffloadOptimizer(params, bucket_size=2 * WIDTH * WIDTH, max_inflight_buckets=2, **options)
    x = torch.randn(4, WIDTH, device="cuda", dtype=torch.bfloat16)
    extra = _extra_peak(lambda: model(x).float().sum().backward())
    opt.step()
    assert opt.memory_stats()["device_bytes"] == 0
    return extra


def test_a_cpu_model_handed_over_holds_only_its_bf16_weights_on_the_gpu():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # fp32, on the CPU
    fp32 = [p.detach().clone() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    opt = OffloadOptimizer(model.parameters(), **HYPER, device="cuda")
    weights = 2 * sum(p.numel() for p in fp32)
    assert torch.cuda.memory_allocated() - base == weights
    assert torch.cuda.max_memory_allocated() - base <= weights + 4 * 1024 * 1024 + 2**20  # one fp32 param in flight
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(m, v) for m, v in zip(opt.master_weights(), fp32))
    model.to("cuda")  # the buffers (none here); the params are there already
    model(torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert all(
        torch.equal(p.detach().cpu(), m.to(torch.bfloat16)) for p, m in zip(model.parameters(), opt.master_weights())
    )


def test_device_memory_bounded_with_unused_params():
    model = _mlp(used=LAYERS // 2)  # every bucket of the used half is full; the rest never fill
    params = list(model.parameters())
    order = [p for pair in zip(params[: LAYERS // 2], params[LAYERS // 2 :]) for p in pair]  # each bucket half unused
    extra = _backward_extra(model, order)
    assert extra <= _bound(2 * LAYER_BYTES), f"{extra / 2**20:.0f} MiB held during backward"


def test_device_memory_bounded_with_shuffled_registration_order():
    model = _mlp()
    params = list(model.parameters())
    order = [params[i] for i in torch.randperm(LAYERS, generator=torch.Generator().manual_seed(0))]
    extra = _backward_extra(model, order)
    assert extra <= _bound(2 * LAYER_BYTES), f"{extra / 2**20:.0f} MiB held during backward"


def test_device_memory_with_torch_compile_is_the_grads_plus_the_buckets():
    # A compiled backward returns every grad at once, before any hook can take one: device
    # memory for grads is then the model's grads, as without the optimizer, plus its buckets.
    model = _mlp()
    grads = sum(p.numel() * 2 for p in model.parameters())
    extra = _backward_extra(torch.compile(model), list(model.parameters()))
    assert extra <= grads + _bound(2 * LAYER_BYTES), f"{extra / 2**20:.0f} MiB held during backward"


# -- the training loops people run ----------------------------------------------------------------


def _out_of_memory(grad: torch.Tensor) -> None:
    torch.empty(1 << 46, dtype=torch.uint8, device=grad.device)  # a real CUDA OOM, mid-backward


def test_oom_in_backward_then_training_continues_as_if_the_batch_never_happened():
    data = batches(4, device="cuda")

    def train(fail_at: int | None) -> list[torch.Tensor]:
        model = make_model(0, device="cuda")
        opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=1024)
        for i, tokens in enumerate(data):
            FailingBackward.fail = _out_of_memory if i == fail_at else None
            try:
                loss_failing_midway(model, tokens).backward()
            except torch.cuda.OutOfMemoryError:
                opt.zero_grad()
                continue
            finally:
                FailingBackward.fail = None
            opt.step()
        torch.cuda.synchronize()
        weights = [p.detach().clone() for p in model.parameters()]
        opt_state = opt.state_dict()["state"][0]
        return weights + [opt_state[k].clone() for k in ("master", "exp_avg", "exp_avg_sq")]

    for a, b in zip(train(fail_at=1), _without_batch(data, 1)):
        assert torch.equal(a, b), "a failed backward changed the training that followed it"


def _without_batch(data: list[torch.Tensor], skip: int) -> list[torch.Tensor]:
    model = make_model(0, device="cuda")
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=1024)
    for i, tokens in enumerate(data):
        if i != skip:
            loss_failing_midway(model, tokens).backward()
            opt.step()
    torch.cuda.synchronize()
    opt_state = opt.state_dict()["state"][0]
    weights = [p.detach().clone() for p in model.parameters()]
    return weights + [opt_state[k].clone() for k in ("master", "exp_avg", "exp_avg_sq")]


def test_reentrant_checkpointing_with_a_shared_param_matches_adamw():
    model = make_model(0, device="cuda")
    params = list(model.parameters())
    tap = GradTap(params)
    opt = OffloadOptimizer(params, **HYPER, bucket_size=1024)
    oracle = AdamWOracle([{"params": params}], **HYPER)
    for tokens in batches(4, device="cuda"):
        reentrant_checkpointed_loss(model, tokens).backward()
        assert opt._rooms.window.micro == 1
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, params, oracle)


def test_model_moved_to_the_gpu_after_construction_raises_at_step():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=1024)
    model.cuda()
    lm_loss(model, batches(1, device="cuda")[0]).backward()
    with pytest.raises(RuntimeError, match="converted or moved after the optimizer was built"):
        opt.step()


def test_two_param_groups_match_adamw():
    model = make_model(0, device="cuda")
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]
    tap = GradTap(params)
    opt = OffloadOptimizer(groups, lr=1e-3, betas=(0.9, 0.99), bucket_size=1024)
    oracle = AdamWOracle(groups, lr=1e-3, betas=(0.9, 0.99))
    for tokens in batches(4, device="cuda"):
        lm_loss(model, tokens).backward()
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, decay + no_decay, oracle)


def test_forward_right_after_load_state_dict_sees_the_loaded_weights():
    import copy

    model, _, _, opt, _ = build()
    data = batches(4, device="cuda")
    for tokens in data[:2]:
        lm_loss(model, tokens).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    with torch.no_grad():
        expected = model(data[0])
    for tokens in data[2:]:
        lm_loss(model, tokens).backward()
        opt.step()
    _slow_side_stream_copies(opt)
    opt.load_state_dict(saved)
    with torch.no_grad():
        early = model(data[0])  # queued at once, no host sync
    assert torch.equal(early, expected), "the forward right after load_state_dict did not see the loaded weights"


def test_grad_scaler_is_refused_or_works():
    model, params, tap, opt, oracle = build()
    scaler = torch.amp.GradScaler("cuda")
    tokens = batches(1, device="cuda")[0]
    scaler.scale(lm_loss(model, tokens)).backward()
    try:
        scaler.step(opt)
        scaler.update()
    except Exception as e:  # a refusal must say what to do
        assert "OffloadOptimizer" in str(e) and "GradScaler" in str(e), f"unclear error: {type(e).__name__}: {e}"
        return
    oracle.step({k: v / scaler.get_scale() for k, v in tap.take().items()})
    assert_matches_oracle(opt, params, oracle)


def test_cuda_graph_capture_is_refused_or_works():
    model, _, _, opt, _ = build()
    tokens = batches(1, device="cuda")[0]
    lm_loss(model, tokens).backward()  # warm-up outside the graph, as CUDA graph recipes do
    opt.step()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            lm_loss(model, tokens).backward()
            opt.step()
    except Exception as e:
        assert "OffloadOptimizer" in str(e) and "graph" in str(e).lower(), f"unclear error: {type(e).__name__}: {e}"
        return
    graph.replay()  # captured: then it has to train
    torch.cuda.synchronize()


# -- ZeRO on one GPU: two gloo ranks over CUDA tensors (NCCL refuses two ranks on one GPU) ----------


def _zero_gloo_cuda_rank(rank: int, world_size: int, out: Path) -> None:
    import torch.distributed as dist

    # Every rank the same batches: the mean over ranks is exact, so 2 ranks equal 1 process bitwise.
    model = make_model(0, device="cuda")
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=1024, process_group=dist.group.WORLD)
    for tokens in batches(4, device="cuda"):
        lm_loss(model, tokens).backward()
        opt.step()
    weights = [p.detach().cpu() for p in model.parameters()]
    torch.save({"state": opt.state_dict(), "weights": weights}, out / f"{rank}.pt")


@pytest.mark.dist
def test_zero_with_gloo_on_cuda_tensors_equals_one_process(tmp_path: Path):
    from rank_spawn import run_ranks

    from cpu_adam.distributed import consolidate_state_dict

    run_ranks(_zero_gloo_cuda_rank, tmp_path, world_size=2, timeout_s=120)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    model = make_model(0, device="cuda")
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=1024)
    for tokens in batches(4, device="cuda"):
        lm_loss(model, tokens).backward()
        opt.step()
    full = consolidate_state_dict([r["state"] for r in ranks])
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(full["state"][0][name], opt.state_dict()["state"][0][name]), name
    for rank in ranks:
        assert all(torch.equal(a, b.cpu()) for a, b in zip(rank["weights"], model.parameters()))


# No clipping: every step's previews are taken. Clipping every step: the previews stop as the grads' norm passes the
# limit, and the step runs serially.
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_stepping_during_backward_is_bitwise_the_serial_step_on_cuda(max_norm: float | None):
    runs = {}
    for overlap in ("none", "backward"):
        model = make_model(0, device="cuda")
        opt = OffloadOptimizer(model.parameters(), **HYPER, max_grad_norm=max_norm, bucket_size=1024, overlap=overlap)
        held = []
        for tokens in batches(6, device="cuda"):
            lm_loss(model, tokens).backward()
            opt.step()
            held.append(opt.last_step_overlapped)
        state = opt.state_dict()["state"][0]
        runs[overlap] = [p.detach().cpu().clone() for p in model.parameters()]
        runs[overlap] += [state[k].clone() for k in ("master", "exp_avg", "exp_avg_sq")]
        if overlap == "backward":
            assert held == [max_norm is None] * len(held), held
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(runs["none"], runs["backward"]))
