"""The offload optimizer at the edges of its layout: the padding between params, zero-size params, a param group
of frozen params alone, a model with no elements to train. Each against the all-host run's bits, on both devices
("copying" is the GPU's code path), with and without a device share and overlap="backward"."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import raw
from test_offload_digest import _device

from cpu_adam import OffloadOptimizer

pytest.importorskip("triton", reason="the device kernel is written in Triton")

BUCKET = 1024


def _params(sizes: list[int], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16)) for n in sizes]


def _train(
    sizes: list[int], shares: list[float], device: str, bucket_size: int = BUCKET, **options: Any
) -> tuple[OffloadOptimizer, list[list[torch.Tensor]]]:
    """Steps whose grads are nonzero everywhere (so that eps=0 divides no zero by zero in a param), a share each;
    returns the optimizer and the weights after every step."""
    params = _params(sizes)
    g = torch.Generator().manual_seed(1)
    with _device(device):
        opt = OffloadOptimizer(params, lr=1e-2, bucket_size=bucket_size, **options)
    seen = []
    for share in shares:
        opt.device_fraction = share
        slopes = [(torch.rand(p.shape, generator=g) + 0.5) * torch.randn(p.shape, generator=g).sign() for p in params]
        sum((p.float() * c).sum() for p, c in zip(params, slopes)).backward()
        opt.step()
        opt.zero_grad()
        seen.append([raw(p) for p in params])
    return opt, seen


def _differing_steps(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> list[int]:
    return [step for step, (x, y) in enumerate(zip(a, b)) if not all(map(torch.equal, x, y))]


# -- padding is never stepped ------------------------------------------------------------------------------------

# Params that end inside a scale block (padding after them) and one that fills its blocks, in one bucket.
PADDED = [200, 100, 256, 300, 5]
EPS0 = {
    "fp32": dict(eps=0.0, weight_decay=0.1),
    "8-bit, L2": dict(eps=0.0, weight_decay=0.1, adamw_mode=False, state_precision="8bit"),
}


@pytest.mark.parametrize("share", [0.0, 1.0])
@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("device", ["cpu", "copying"])
@pytest.mark.parametrize("precision", list(EPS0))
def test_padding_is_never_stepped_even_where_eps_0_makes_nan_of_it(precision: str, device: str, overlap: str, share):
    options = dict(EPS0[precision], bucket_size=4096)
    opt, weights = _train(PADDED, [share] * 3, device, overlap=overlap, **options)
    # The reference steps each param alone (the kernel writes into the params' own storage): no padding in it.
    reference = _train(PADDED, [0.0] * 3, "cpu", **options)[1]
    saved = opt.state_dict()
    for name, t in saved["state"][0].items():
        if torch.is_tensor(t) and t.is_floating_point():
            assert bool(t.isfinite().all()), f"{name} holds a non-finite value (padding stepped)"
    assert _differing_steps(weights, reference) == [], "the params' weights differ from the all-host run's"
    fresh = OffloadOptimizer(_params(PADDED), bucket_size=4096, **EPS0[precision])
    fresh.load_state_dict(saved)  # refused where the padding held NaN
    fresh.close()
    opt.close()


# -- zero-size params ----------------------------------------------------------------------------------------------

# Zero-size params first, among others, alone in a bucket (between two larger than a bucket), and last.
WITH_EMPTY = [0, 300, 0, 2000, 0, 2000, 100, 0]
MOVING = [0.5, 1.0, 0.0, 1.0, 0.3]


@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("device", ["cpu", "copying"])
def test_zero_size_params_with_any_share_give_the_all_host_weights(device: str, overlap: str):
    shared = _train(WITH_EMPTY, MOVING, device, overlap=overlap)
    host = _train(WITH_EMPTY, [0.0] * len(MOVING), device)
    assert _differing_steps(shared[1], host[1]) == []
    assert _state(shared[0]) == _state(host[0])


def _state(opt: OffloadOptimizer) -> list:
    state = opt.state_dict()["state"]
    out = [raw(t) if torch.is_tensor(t) else t for g in state.values() for t in g.values()]
    opt.close()
    return [t.tolist() if torch.is_tensor(t) else t for t in out]


def test_memory_stats_with_a_zero_size_param_alone_to_train():
    empty, frozen = torch.nn.Parameter(torch.zeros(0, 3, dtype=torch.bfloat16)), _params([10])[0]
    frozen.requires_grad_(False)
    opt = OffloadOptimizer([{"params": [empty]}, {"params": [frozen]}])
    stats = opt.memory_stats()
    assert stats["params"] == 0 and math.isnan(stats["host_bytes_per_param"]) and stats["host_bytes"] > 0
    opt.close()


# -- a group of frozen params alone --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_a_group_of_frozen_params_alone_with_bf16_masters_on_the_gpu_path_steps_as_on_the_host(overlap: str):
    def run(device: str) -> list[list[torch.Tensor]]:
        params = _params([300, 40, 500, 64])
        params[1].requires_grad_(False)
        groups = [{"params": params[:1]}, {"params": params[1:2]}, {"params": params[2:]}]
        with _device(device):
            opt = OffloadOptimizer(groups, lr=1e-2, master_weights_dtype=torch.bfloat16, overlap=overlap)
        seen = []
        for step in range(3):
            sum(p.float().square().sum() * (step + 1) for p in params if p.requires_grad).backward()
            opt.step()
            opt.zero_grad()
            seen.append([raw(p) for p in params])
        opt.close()
        return seen

    assert _differing_steps(run("copying"), run("cpu")) == []
