"""OffloadOptimizer with 8-bit moments: the same step as CPUAdam's 8-bit states, its bytes, its state dicts."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from offload_helpers import CopyingCPU, GradTap, batches, lm_loss, make_model
from torch import Tensor, nn

from cpu_adam import CPUAdam, offload, quant8
from cpu_adam.offload import LEGACY_FORMAT, OffloadOptimizer
from cpu_adam.offload.layout import LEGACY_ALIGN, FlatLayout, canonical_offsets

BUCKET = 1024  # elements: the tiny model spans several buckets
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
EIGHT_BIT = {"state_precision": "8bit"}
EIGHT_BIT_BF16_SR = {"state_precision": "8bit", "master_weights_dtype": torch.bfloat16, "stochastic_rounding": True}


def _run(model: nn.Module, opt: OffloadOptimizer, data: list[Tensor]) -> None:
    for tokens in data:
        lm_loss(model, tokens).backward()
        opt.step()


def _per_param(saved: dict[str, Any], name: str, shapes: list[torch.Size]) -> list[Tensor]:
    """Param i's slice of a full state dict's flat tensor (block entries for the scales)."""
    out = []
    for offset, shape in zip(canonical_offsets(shapes), shapes):
        n = shape.numel()
        if name == "state_scales":
            out.append(saved[name][:, offset // quant8.BLOCK : offset // quant8.BLOCK + quant8.blocks(n)])
        else:
            out.append(saved[name][offset : offset + n].view(shape))
    return out


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_step_is_cpu_adams_8bit_step_bit_for_bit(device: str):
    # The offload step over fp32 masters and bf16 grads is CPUAdam's 8-bit step over fp32 params
    # given the same grads (bf16 values held in fp32) and seed: same masters, codes and scales, every
    # step (both place each param's random bits at its offset in the one-process layout).
    model = make_model(0, device=device)
    params = list(model.parameters())
    tap = GradTap(params)
    opt = OffloadOptimizer(params, **HYPER, bucket_size=BUCKET, **EIGHT_BIT, seed=5)
    masters = [p.detach().float().cpu() for p in params]
    twin = CPUAdam(masters, **HYPER, state_precision="8bit", seed=5)  # the same random bits for the codes
    for tokens in batches(5, device=device):
        lm_loss(model, tokens).backward()
        grads = tap.take()
        for p, master in zip(params, masters):
            master.grad = grads[id(p)].cpu()
        twin.step()
        opt.step()
    full = opt.state_dict()["state"][0]
    shapes = [p.shape for p in params]
    for p, mine, ref in zip(params, opt.master_weights(), masters):
        assert torch.equal(mine, ref)
        assert torch.equal(p.detach().cpu(), ref.to(torch.bfloat16))
    for name in ("exp_avg", "exp_avg_sq", "state_scales"):
        for mine, ref in zip(_per_param(full, name, shapes), masters):
            assert torch.equal(mine, twin.state[ref][name]), name


def test_the_gpu_copy_path_steps_as_the_cpu_path(monkeypatch: pytest.MonkeyPatch):
    # On the GPU path consecutive params of a bucket share one kernel call, their 8-bit blocks
    # side by side (with zero padding); on the CPU each param is its own call. Same bits, with
    # accumulated (fp32) grads in some steps.
    def train() -> tuple[nn.Module, OffloadOptimizer]:
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, max_grad_norm=0.5, **EIGHT_BIT)
        for i, tokens in enumerate(batches(4)):
            for chunk in tokens.chunk(2 if i % 2 else 1):
                lm_loss(model, chunk).backward()
            opt.step()
        return model, opt

    direct_model, direct = train()
    monkeypatch.setattr(offload.rooms, "DeviceOps", CopyingCPU)
    copied_model, copied = train()
    a, b = direct.state_dict()["state"][0], copied.state_dict()["state"][0]
    for name in ("master", "exp_avg", "exp_avg_sq", "state_scales"):
        assert torch.equal(a[name], b[name]), name
    assert all(torch.equal(x, y) for x, y in zip(direct_model.parameters(), copied_model.parameters()))


@pytest.mark.parametrize(("options", "per_param", "bound"), [(EIGHT_BIT, 8, 8.1), (EIGHT_BIT_BF16_SR, 6, 6.1)])
def test_host_bytes_per_param(options: dict[str, Any], per_param: int, bound: float):
    model = nn.Linear(1024, 1024, bias=False).to(torch.bfloat16)  # aligned: no padding
    stats = OffloadOptimizer(model.parameters(), **options).memory_stats()
    scale_bytes = 2 * 4 / quant8.BLOCK  # two float32 scales per block of 256
    assert stats["host_bytes_per_param"] == per_param + scale_bytes <= bound
    assert stats["state_bytes"] == (2 + scale_bytes) * 1024 * 1024


@pytest.mark.parametrize("options", [EIGHT_BIT, EIGHT_BIT_BF16_SR], ids=["fp32-master", "bf16-master-sr"])
def test_resume_is_bit_exact(options: dict[str, Any]):
    data = batches(6)
    straight = make_model(0)
    straight_opt = OffloadOptimizer(straight.parameters(), **HYPER, bucket_size=BUCKET, **options)
    _run(straight, straight_opt, data)

    first = make_model(0)
    first_opt = OffloadOptimizer(first.parameters(), **HYPER, bucket_size=BUCKET, **options)
    _run(first, first_opt, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = make_model(seed=123)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = OffloadOptimizer(resumed.parameters(), lr=0.5, bucket_size=BUCKET, **options)
    resumed_opt.load_state_dict(checkpoint["opt"])
    _run(resumed, resumed_opt, data[3:])

    s, r = straight_opt.state_dict()["state"][0], resumed_opt.state_dict()["state"][0]
    assert s["exp_avg"].dtype == torch.uint8 and s["state_scales"].dtype == torch.float32
    for name in ("master", "exp_avg", "exp_avg_sq", "state_scales"):
        assert torch.equal(s[name], r[name]), name
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def _trained(steps: int = 3, **options: Any) -> dict[str, Any]:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, **options)
    _run(model, opt, batches(steps))
    return opt.state_dict()


def test_an_8bit_state_dict_loads_dequantized_into_float_states_and_back():
    saved_dict = _trained(**EIGHT_BIT)
    saved = saved_dict["state"]
    fp32 = OffloadOptimizer(make_model(1).parameters(), **HYPER, bucket_size=BUCKET)
    fp32.load_state_dict(saved_dict)
    loaded = fp32.state_dict()["state"][0]
    exp_avg, exp_avg_sq = quant8.dequantize_moments(
        saved[0]["exp_avg"], saved[0]["exp_avg_sq"], saved[0]["state_scales"]
    )
    assert loaded["exp_avg"].dtype == torch.float32
    assert torch.equal(loaded["exp_avg"], exp_avg) and torch.equal(loaded["exp_avg_sq"], exp_avg_sq)
    assert torch.equal(loaded["master"], saved[0]["master"])

    back = OffloadOptimizer(make_model(2).parameters(), **HYPER, bucket_size=BUCKET, **EIGHT_BIT)
    back.load_state_dict(fp32.state_dict())  # the decoded values encode to themselves
    again = back.state_dict()["state"][0]
    moments = quant8.dequantize_moments(again["exp_avg"], again["exp_avg_sq"], again["state_scales"])
    assert torch.equal(moments[0], exp_avg) and torch.equal(moments[1], exp_avg_sq)


def test_float_states_load_quantized_into_an_8bit_optimizer():
    saved = _trained(state_precision="bf16")
    eight = OffloadOptimizer(make_model(1).parameters(), **HYPER, bucket_size=BUCKET, **EIGHT_BIT)
    eight.load_state_dict(saved)
    codes = quant8.quantize_moments(saved["state"][0]["exp_avg"], saved["state"][0]["exp_avg_sq"])
    loaded = eight.state_dict()["state"][0]
    for name, expected in zip(("exp_avg", "exp_avg_sq", "state_scales"), codes):
        assert torch.equal(loaded[name], expected), name
    model = make_model(1)
    eight = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, **EIGHT_BIT)
    eight.load_state_dict(saved)
    _run(model, eight, batches(2, seed=5))  # and trains on
    assert eight.state_dict()["state"][0]["step"] == 5


def test_a_format_1_state_dict_loads_with_its_old_layout():
    # Format 1 put params on 64-element boundaries; its full state dicts still load.
    saved = _trained()
    shapes = [torch.Size(s) for s in saved["state"][0]["shapes"]]
    old = FlatLayout(shapes, 1 << 62, align=LEGACY_ALIGN)
    legacy = dict(saved, format=LEGACY_FORMAT, state={0: dict(saved["state"][0])})
    for name in ("master", "exp_avg", "exp_avg_sq"):
        flat = torch.full((old.numel,), float("nan"))  # padding the loader must not read
        for i, values in enumerate(_per_param(saved["state"][0], name, shapes)):
            lo, hi = old.param_range(i)
            flat[lo:hi] = values.reshape(-1)
        legacy["state"][0][name] = flat
    opt = OffloadOptimizer(make_model(1).parameters(), **HYPER, bucket_size=BUCKET)
    opt.load_state_dict(legacy)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(opt.state_dict()["state"][0][name], saved["state"][0][name]), name


def test_a_state_dict_of_other_params_is_refused_before_anything_changes():
    saved = _trained(**EIGHT_BIT)
    saved["state"][0]["state_scales"] = saved["state"][0]["state_scales"][:, :-1]
    model = make_model(1)
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, **EIGHT_BIT)
    _run(model, opt, batches(1))
    before = {k: v.clone() for k, v in opt.state_dict()["state"][0].items() if torch.is_tensor(v)}
    with pytest.raises(ValueError, match="state_scales has shape"):
        opt.load_state_dict(saved)
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    assert after["step"] == 1


def test_state_precision_and_the_shorthand_must_agree():
    model = make_model(0)
    with pytest.raises(ValueError, match="state_precision must be one of"):
        OffloadOptimizer(model.parameters(), state_precision="int4")
    with pytest.raises(ValueError, match="fp32_optimizer_states=True means state_precision='fp32'"):
        OffloadOptimizer(model.parameters(), state_precision="8bit", fp32_optimizer_states=True)
    assert OffloadOptimizer(model.parameters(), fp32_optimizer_states=False).state_dtype == torch.bfloat16
