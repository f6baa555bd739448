"""The device kernel under the ARM rule (tiny before rounding) against an AArch64 host kernel's own steps.

tests/arm/aarch64_steps.bin holds steps of the AArch64 scalar kernel, run under qemu-aarch64 by
tests/arm/run.sh, which rewrites it and fails where it changed: each step's inputs, the scalars the
kernel received (folded by the driver, never here) and its results with denormals flushed. Its
format is documented at write_steps in tests/kernels/driver.cpp. The device kernel runs each step
here through Triton's interpreter with those very scalars, and must write the host's bits.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import raw

from cpu_adam import ops

pytest.importorskip("triton", reason="the device kernel is written in Triton")

from cpu_adam import device_kernel

FIXTURE = Path(__file__).parent / "arm" / "aarch64_steps.bin"
DTYPES = (torch.float32, torch.bfloat16, torch.uint8)  # the fixture's codes 0, 1, 2
DATA = ("random", "tiny", "edge", "edge_l2")  # the driver's enum Data
OUT, OUT_IS_GRAD, STOCHASTIC, LERP_FROM_GRAD = 1, 2, 4, 8
BLOCK = 256


@dataclass
class Step:
    layout: tuple[torch.dtype, torch.dtype, torch.dtype]
    data: str
    flags: int
    variant: int
    n: int
    first_counter: int
    keys: tuple[int, int]
    wrap: int
    hyper: ops.FoldedHyper
    inputs: dict[str, torch.Tensor]
    results: dict[str, torch.Tensor]

    def __str__(self) -> str:
        names = "/".join(str(d).removeprefix("torch.") for d in self.layout)
        return f"{self.data} {names} variant {self.variant} flags {self.flags:#x} n={self.n}"


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def tensor(self, dtype: torch.dtype, count: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        t = torch.frombuffer(bytearray(self.data[self.at : self.at + size * count]), dtype=dtype)
        self.at += size * count
        return t


def read_steps(path: Path = FIXTURE) -> list[Step]:
    r = _Reader(path.read_bytes())
    magic, version, count = r.unpack("8sII")
    assert (magic, version) == (b"ADAMSTEP", 1), f"{path} is not a version 1 steps file"
    steps = []
    for _ in range(count):
        p, g, s, data, flags, variant, _, _ = r.unpack("8B")
        n, first_counter, key, key_after_wrap, wrap = r.unpack("5I")
        floats = r.unpack("10f")
        hyper = ops.FoldedHyper(*floats[:7], bool(flags & LERP_FROM_GRAD), *floats[7:])
        layout = (DTYPES[p], DTYPES[g], DTYPES[s])
        names = ["param", "grad", "exp_avg", "exp_avg_sq"]
        inputs = {name: r.tensor(dtype, n) for name, dtype in zip(names, (*layout, layout[2]))}
        blocks = -(-n // BLOCK)
        if layout[2] == torch.uint8:
            inputs["scales"] = r.tensor(torch.float32, 2 * blocks).view(2, blocks)
        results = {name: r.tensor(t.dtype, n) for name, t in inputs.items() if name != "scales"}
        if flags & OUT and not flags & OUT_IS_GRAD:
            results["out"] = r.tensor(torch.bfloat16, n)
        if layout[2] == torch.uint8:
            results["scales"] = r.tensor(torch.float32, 2 * blocks).view(2, blocks)
        step = Step(layout, DATA[data], flags, variant, n, first_counter, (key, key_after_wrap), wrap, hyper, {}, {})
        step.inputs, step.results = inputs, results
        steps.append(step)
    assert r.at == len(r.data), f"{path}: {len(r.data) - r.at} bytes after its last step"
    return steps


STEPS = read_steps()


def run_device(step: Step, before_rounding: bool) -> dict[str, torch.Tensor]:
    """The step through the device kernel (interpreted), its launch built as prepare_step builds one."""
    t = {name: x.clone() for name, x in step.inputs.items()}
    if step.flags & OUT:
        t["out"] = t["grad"] if step.flags & OUT_IS_GRAD else torch.full((step.n,), float("nan"), dtype=torch.bfloat16)
    tensors = (t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], t.get("out"), t.get("scales"))
    launches = device_kernel.Launches()
    stochastic = bool(step.flags & STOCHASTIC)
    device_kernel.add_launch(
        launches, step.hyper, tensors, 0, step.n, step.first_counter, step.keys, step.wrap, stochastic, before_rounding
    )
    launches()
    return {name: t[name] for name in step.results}


def differences(step: Step, before_rounding: bool) -> list[str]:
    actual = run_device(step, before_rounding)
    found = []
    for name, expected in step.results.items():
        differ = raw(actual[name]) != raw(expected)
        if differ.any():
            found.append(f"{step}: {name} differs in {int(differ.sum())} bytes")
    return found


def test_the_fixture_holds_every_layout_and_the_cases_where_flushing_decides() -> None:
    layouts = {s.layout for s in STEPS}
    assert len(layouts) == 12
    for layout in layouts:
        mine = [s for s in STEPS if s.layout == layout]
        assert {s.data for s in mine} == set(DATA)
        assert any(s.hyper.l2 != 0 for s in mine) and any(s.hyper.l2 == 0 for s in mine)
        assert any(s.flags & STOCHASTIC for s in mine) and any(s.flags & OUT for s in mine)
        assert any(s.n % BLOCK and s.n > BLOCK for s in mine)  # ends inside its second 8-bit block
    assert any(s.layout[1] == torch.bfloat16 and s.flags & OUT_IS_GRAD for s in STEPS)
    assert any(s.wrap < s.n for s in STEPS)  # the 32-bit counter wraps inside an 8-bit segment


def test_the_device_kernel_under_the_arm_rule_writes_the_aarch64_host_kernels_bits() -> None:
    found = [d for step in STEPS for d in differences(step, before_rounding=True)]
    assert not found, "\n".join(found[:20])


def test_the_x86_rule_fails_every_edge_step() -> None:
    """The fixture tells the rules apart: in each edge step some grad times its scale (a product), or some param
    times its L2 weight decay plus a zero grad (a fused multiply-add), rounds up to 2^-126, which x86-64 keeps and
    AArch64 flushed. Random and tiny inputs almost never land there."""
    edges = [step for step in STEPS if step.data.startswith("edge")]
    assert len(edges) == 36
    for step in edges:
        assert differences(step, before_rounding=False), f"{step}: no difference under the x86 rule"
