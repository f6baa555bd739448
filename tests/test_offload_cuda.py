"""OffloadOptimizer on a CUDA device: parity, bounded device memory, stream ordering."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import AdamWOracle, GradTap, assert_matches_oracle, batches, lm_loss, make_model
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
    group = opt._groups[0]
    assert group.grads.tensor.is_pinned()
    assert stats["pinned_bytes"] == 2 * group.layout.numel


def test_parity_with_torch_adamw_on_cuda():
    model, params, tap, opt, oracle = build(max_norm=0.5)
    for tokens in batches(24, device="cuda"):
        lm_loss(model, tokens).backward()
        norm = oracle.step(tap.take(), max_norm=0.5)
        opt.step()
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-4)
        assert_matches_oracle(opt, params, oracle)


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
    copy = opt._dev.copy

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        torch.cuda._sleep(SLEEP_CYCLES)  # queued on the current stream: the side stream here
        copy(dst, src)

    opt._dev.copy = slow_copy


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
