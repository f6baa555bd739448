"""The device kernel's truth on a real GPU, counted rather than asserted (about a minute; run first by gpu_check.sh).

Triton's interpreter runs the device kernel's source on the CPU, but not the GPU's own arithmetic: this probe
asks the GPU what it computes and counts, where a test would stop at the first difference:

- nan: the bits of the NaNs the GPU writes (0/0, inf - inf, sqrt(-1), and an eps=0 Adam step), beside the host's;
- layouts: every layout and variant of tests/test_device_kernel.py on CUDA against the host kernel, the
  differences in non-NaN elements counted apart from those where both are NaN with other bits;
- binades: ``div_rn`` and ``sqrt_rn`` over every binade of float32 against correctly rounded references (float64
  arithmetic rounded once to float32: 53 >= 2 * 24 + 2 bits, so the double rounding is innocuous);
- key1: a step whose random keys all equal 1 (Triton compiles an integer argument of 1 as a constant unless told
  not to), on CUDA against the interpreter's;
- arm: the ARM rule (tininess before rounding) compiled for the GPU, every layout against the interpreter's.

    python benchmarks/gpu_probe.py --json probe.json             # every part, one process
    python benchmarks/gpu_probe.py --part 3/8 --json part3.json   # every 8th case from the 4th: parts run at once
    python benchmarks/gpu_probe.py --summary part*.json           # totals, and every case that differs or failed

A part's cases are its share of every list, so eight processes compile the kernel variants eight at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import triton
import triton.language as tl
from test_device_kernel import HYPER, LAYOUTS, SIZES, VARIANTS, make_tuple, step

import cpu_adam.device_kernel as device_kernel
from cpu_adam import ops
from cpu_adam.device_kernel.floats import div, sqrt, sub
from cpu_adam.device_kernel.launch import for_device

DEVICE = "cuda"  # --device cpu: a smoke run of this script, the interpreter against itself where CUDA would be


@triton.jit
def invalid(a_ptr, b_ptr, out_ptr, OP: tl.constexpr):
    i = tl.arange(0, 4)
    a, b = tl.load(a_ptr + i), tl.load(b_ptr + i)
    r = div(a, b, False) if OP == 0 else (sub(a, b) if OP == 1 else sqrt(a))
    tl.store(out_ptr + i, r)


@triton.jit
def rounded_once(a_ptr, b_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    a, b = tl.load(a_ptr + i, mask=mask), tl.load(b_ptr + i, mask=mask)
    r = tl.math.div_rn(a, b) if OP == 0 else tl.math.sqrt_rn(a)
    tl.store(out_ptr + i, r, mask=mask)


def nan_aware_counts(device: dict[str, torch.Tensor], host: dict[str, torch.Tensor]) -> dict[str, int]:
    """Elements whose bits differ: ``value`` where either is not NaN, ``nan_bits`` where both are NaN."""
    counts = {"elements": 0, "value": 0, "nan_bits": 0}
    for name, expected in host.items():
        actual = device[name].reshape(-1)
        expected = expected.reshape(-1)
        if expected.is_floating_point():
            both_nan = actual.isnan() & expected.isnan()
            differ = actual.view(_int_of(actual)) != expected.view(_int_of(expected))
            counts["value"] += int((differ & ~both_nan).sum())
            counts["nan_bits"] += int((differ & both_nan).sum())
        else:
            counts["value"] += int((actual != expected).sum())
        counts["elements"] += expected.numel()
    return counts


def _int_of(t: torch.Tensor) -> torch.dtype:
    return {4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]


def nan_bits(t: torch.Tensor) -> list[str]:
    """The distinct bit patterns of t's NaNs, in hex."""
    if not t.is_floating_point():
        return []
    patterns = t.reshape(-1)[t.reshape(-1).isnan()].view(_int_of(t)).unique().tolist()
    width = 2 * t.element_size()
    return [f"0x{p & ((1 << (4 * width)) - 1):0{width}X}" for p in patterns]


def part_nan() -> dict[str, Any]:
    found: dict[str, Any] = {}
    cases = {"0/0": (0.0, 0.0), "inf-inf": (float("inf"), float("inf")), "sqrt(-1)": (-1.0, 0.0)}
    for code, (name, (x, y)) in enumerate(cases.items()):
        a, b = torch.full((4,), x, device=DEVICE), torch.full((4,), y, device=DEVICE)
        out = torch.empty(4, device=DEVICE)
        for_device(invalid, a.device)[(1,)](a, b, out, OP=code)
        found[f"device {name}"] = nan_bits(out.cpu())
        a_host, b_host = a.cpu(), b.cpu()
        host = {"0/0": a_host / b_host, "inf-inf": a_host - b_host, "sqrt(-1)": a_host.sqrt()}[name]
        found[f"torch cpu {name}"] = nan_bits(host)
    # An Adam step with eps=0 over zeros: m / (sqrt(v) + eps) is 0/0 in every element.
    for layout in [("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("bf16", "f32", "q8")]:
        tensors = make_tuple(1000, layout, seed=0)
        for key in ("grad", "exp_avg", "exp_avg_sq"):
            tensors[key] = torch.zeros_like(tensors[key])
        kwargs = {**HYPER, "eps": 0.0, "step": 1}
        host = step(ops.adam_step, tensors, "cpu", True, **kwargs)
        dev = step(device_kernel.adam_step, tensors, DEVICE, True, before_rounding=False, **kwargs)
        for name in host:
            found["-".join(layout) + f" eps=0 {name}"] = {"host": nan_bits(host[name]), "device": nan_bits(dev[name])}
        found["-".join(layout) + " eps=0 differences"] = nan_aware_counts(dev, host)
    return found


def cases_layouts() -> Iterator[tuple[str, Callable[[], dict[str, int]]]]:
    for layout in LAYOUTS:
        for name, variant in VARIANTS.items():
            for tiny in (False, True):

                def run(layout: tuple[str, str, str] = layout, variant: dict = variant, tiny: bool = tiny) -> dict:
                    total: dict[str, int] = {}
                    for n in [*SIZES, 100003]:
                        kwargs = {**HYPER, **variant}
                        with_out = kwargs.pop("with_out", False)
                        if tiny:
                            kwargs.update(eps=0.0 if n % 2 else 1e-30)
                        tensors = make_tuple(n, layout, seed=n, tiny=tiny)
                        host = step(ops.adam_step, tensors, "cpu", with_out, **kwargs)
                        dev = step(device_kernel.adam_step, tensors, DEVICE, with_out, before_rounding=False, **kwargs)
                        for k, v in nan_aware_counts(dev, host).items():
                            total[k] = total.get(k, 0) + v
                    return total

                yield f"{'-'.join(layout)} {name}{' tiny' if tiny else ''}", run


def binade_operands(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every float32 binade, normal and denormal, with random significands, either sign; and a second operand so."""
    g = torch.Generator().manual_seed(seed)
    per_binade = 4096
    exponents = torch.arange(-149, 128).repeat_interleave(per_binade)
    significands = 1 + torch.rand(exponents.numel(), generator=g, dtype=torch.float64)
    a = (significands * torch.exp2(exponents.double())).float()
    b = a[torch.randperm(a.numel(), generator=g)]
    return a, b


def part_binades() -> dict[str, Any]:
    found = {}
    a, b = binade_operands(0)
    b = torch.where(torch.rand(b.shape) < 0.5, -b, b)
    for code, op in enumerate(("div_rn", "sqrt_rn")):
        out = torch.empty_like(a, device=DEVICE)
        for_device(rounded_once, out.device)[(-(-a.numel() // 1024),)](
            a.to(DEVICE), b.to(DEVICE), out, a.numel(), OP=code, BLOCK=1024
        )
        reference = (a.double() / b.double() if code == 0 else a.double().sqrt()).float()
        actual = out.cpu()
        counts = nan_aware_counts({"r": actual}, {"r": reference})
        differ = (actual.view(torch.int32) != reference.view(torch.int32)) & ~(actual.isnan() & reference.isnan())
        firsts = [(a[i].item(), b[i].item(), actual[i].item(), reference[i].item()) for i in differ.nonzero()[:5, 0]]
        found[op] = {**counts, "first_differences": firsts}
    return found


@contextmanager
def keys_equal_to_one() -> Iterator[None]:
    real = device_kernel._key
    device_kernel._key = lambda *_: 1
    try:
        yield
    finally:
        device_kernel._key = real


def cases_against_the_interpreter(
    name: str, settings: Callable[[], Any], before_rounding: bool
) -> Iterator[tuple[str, Callable[[], dict[str, int]]]]:
    """Every layout on CUDA against the same source interpreted on the CPU."""
    for layout in LAYOUTS:

        def run(layout: tuple[str, str, str] = layout) -> dict[str, int]:
            kwargs = {**HYPER, "step": 5, "weight_decay": 0.1, "stochastic_rounding": True, "seed": 3}
            tensors = make_tuple(4097, layout, seed=7, tiny=before_rounding)
            with settings():
                cpu = step(device_kernel.adam_step, tensors, "cpu", True, before_rounding=before_rounding, **kwargs)
                dev = step(device_kernel.adam_step, tensors, DEVICE, True, before_rounding=before_rounding, **kwargs)
            return nan_aware_counts(dev, cpu)

        yield f"{name} {'-'.join(layout)}", run


def every_case() -> Iterator[tuple[str, str, Callable[[], Any]]]:
    yield "nan", "nan bits", part_nan
    yield "binades", "div_rn and sqrt_rn", part_binades
    for label, run in cases_layouts():
        yield "layouts", label, run
    for label, run in cases_against_the_interpreter("key=1", keys_equal_to_one, before_rounding=False):
        yield "key1", label, run
    for label, run in cases_against_the_interpreter("arm", nullcontext, before_rounding=True):
        yield "arm", label, run


def summary(paths: list[str]) -> str:
    """The parts' results in a few lines: totals per part, and every case that differs or failed."""
    totals: dict[str, dict[str, int]] = {}
    lines = []
    for path in paths:
        with open(path) as f:
            results = json.load(f)["results"]
        for part, cases in results.items():
            for label, result in cases.items():
                if part in ("nan", "binades"):
                    lines.append(f"{part}: {json.dumps(result)}")
                    continue
                total = totals.setdefault(part, {"cases": 0, "errors": 0, "elements": 0, "value": 0, "nan_bits": 0})
                total["cases"] += 1
                total["errors"] += "error" in result
                for key in ("elements", "value", "nan_bits"):
                    total[key] += result.get(key, 0)
                if "error" in result or result.get("value") or result.get("nan_bits"):
                    lines.append(f"{part} {label}: {json.dumps(result)[:400]}")
    header = [f"{part}: {json.dumps(total)}" for part, total in sorted(totals.items())]
    return "\n".join(header + lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="0/1", help="K/N: every N-th case from the K-th (0-based)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--summary", nargs="+", metavar="JSON", help="print what the parts' JSON files found")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summary:
        print(summary(args.summary))
        return
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_probe.py needs a CUDA GPU (the interpreter's results are tests/test_device_kernel.py's)")
    k, n = (int(x) for x in args.part.split("/"))
    results: dict[str, dict[str, Any]] = {}
    for index, (part, label, run) in enumerate(every_case()):
        if index % n != k:
            continue
        start = time.perf_counter()
        try:
            result = run()
        except Exception as e:  # a case that fails to compile or run is a finding, not the end of the probe
            result = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        results.setdefault(part, {})[label] = result
        print(f"{part:8} {label:40} {time.perf_counter() - start:6.1f} s  {json.dumps(result)[:300]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                    "part": args.part,
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
