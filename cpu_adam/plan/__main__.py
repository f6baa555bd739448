"""python -m cpu_adam.plan: will the offload optimizer fit this model on this GPU and in this host RAM?"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from ..offload.layout import ALIGN
from ..offload.options import DEFAULT_BUCKET_SIZE, OVERLAPS
from ..offload.schedule import OPEN_BUCKETS
from ..offload.window import ACCUMULATOR_DTYPE
from ..quant8 import BLOCK
from . import Row, model_spec, plan, plan_fsdp2
from .probe import DEFAULT_PROBE_SECONDS, measure_bandwidth
from .report import fits, print_fsdp2, render, seconds
from .sizes import PlanError, detect_gpu_memory, detect_host_memory, format_bytes, parse_bytes, parse_count

GIB = 2**30


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cpu_adam.plan",
        description="Host RAM and GPU memory of cpu_adam.OffloadOptimizer for a model, per state precision and "
        "master dtype, whether they fit, and the CPU step time estimated on this machine.",
    )
    parser.add_argument("model", nargs="?", metavar="COUNT|PATH", help="a parameter count or a config.json (folder)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--params", metavar="COUNT", help="parameter count: 1.3B, 350M, 2^24, 124439808")
    model.add_argument("--config", metavar="PATH", help="a Hugging Face config.json (or its folder)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="80GiB, 80GB (default: free memory of the CUDA device)")
    parser.add_argument("--host-memory", metavar="SIZE", help="125GiB (default: MemAvailable of this machine)")
    parser.add_argument(
        "--bucket-size", metavar="ELEMENTS", default=str(DEFAULT_BUCKET_SIZE), help="the optimizer's option (2^23)"
    )
    parser.add_argument("--max-inflight-buckets", metavar="N", type=int, default=2, help="the optimizer's option (2)")
    parser.add_argument("--overlap", choices=OVERLAPS, default="none", help="the optimizer's option")
    parser.add_argument(
        "--device-fraction",
        metavar="F",
        type=float,
        default=0.0,
        help="the optimizer's option: the share the GPU steps, its state counted on the GPU (default 0)",
    )
    parser.add_argument(
        "--accumulation", action="store_true", help="gradient accumulation: count the fp32 accumulator (4 B/param)"
    )
    parser.add_argument(
        "--probe-seconds",
        metavar="S",
        type=float,
        default=DEFAULT_PROBE_SECONDS,
        help=f"the bandwidth probe's time (default {DEFAULT_PROBE_SECONDS}; 0: no estimate)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    fsdp2 = parser.add_argument_group("FSDP2 with CPUOffloadPolicy and CPUAdam stepping the shards")
    fsdp2.add_argument("--fsdp2", action="store_true", help="plan FSDP2 + CPUAdam instead of the offload optimizer")
    fsdp2.add_argument("--world-size", metavar="N", type=int, default=1, help="ranks (GPUs) the model is sharded over")
    fsdp2.add_argument(
        "--ranks-per-host", metavar="N", type=int, help="ranks sharing one host's RAM (default: all, at most 8)"
    )
    fsdp2.add_argument(
        "--unit-params", metavar="COUNT", help="the largest FSDP2 unit's params (default: a config's largest layer)"
    )
    fsdp2.add_argument(
        "--tokens", metavar="N", type=int, default=16384, help="each rank's tokens a step (default 16384: 2048 x 8)"
    )
    fsdp2.add_argument("--forward-ms", metavar="MS", type=float, help="the GPU's forward (default: from --tokens)")
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.model, args.params, args.config)) != 1:
        parser.error("give the model once: a count or a config.json path (7e9, --params 1.3B, --config config.json)")
    try:
        bucket_size = parse_count(args.bucket_size, "--bucket-size")
        spec = model_spec(_model(args))
        gpu, gpu_from = _budget(args.gpu_memory, "--gpu-memory", detect_gpu_memory)
        host, host_from = _budget(args.host_memory, "--host-memory", detect_host_memory)
        bandwidth = measure_bandwidth(args.probe_seconds) if args.probe_seconds > 0 else None
        if args.fsdp2:
            options = dict(ranks_per_host=args.ranks_per_host, unit_params=args.unit_params, bandwidth=bandwidth)
            options.update(tokens=args.tokens, forward_seconds=args.forward_ms and args.forward_ms / 1e3)
            options["probe_seconds"] = 0  # probed above, or not at all
            fsdp2_rows = plan_fsdp2(spec, args.world_size, gpu, host, **options)
    except PlanError as error:
        parser.error(str(error).removeprefix("cpu_adam.plan: "))
    sides = [f"GPU: {_side(gpu, gpu_from)}; host RAM: {_side(host, host_from)}"]
    if bandwidth is not None:
        sides.append(
            f"CPU step: an estimate, from {bandwidth / 1e9:.1f} GB/s moved by a {args.probe_seconds:g} s bandwidth "
            f"probe on this machine ({torch.get_num_threads()} threads)"
        )
    if args.fsdp2:
        print_fsdp2(fsdp2_rows, spec, sides, as_json=args.json)
        return
    try:
        rows = plan(
            spec,
            gpu,
            host,
            bucket_size=bucket_size,
            max_inflight_buckets=args.max_inflight_buckets,
            overlap=args.overlap,
            accumulation=args.accumulation,
            bandwidth=bandwidth,
            probe_seconds=0,
            device_fraction=args.device_fraction,
        )
    except PlanError as error:
        parser.error(str(error).removeprefix("cpu_adam.plan: "))
    if args.json:
        print(json.dumps([dataclasses.asdict(r) | {"fits": r.fits} for r in rows], indent=1))
        return
    print(f"model: {spec.source}, {spec.params:,} trained params; bucket_size {bucket_size:,}, overlap {args.overlap}")
    print("\n".join(sides))
    print()
    print(_table(rows))
    print()
    print(_notes(rows[0], spec.exact, args.max_inflight_buckets))


def _model(args: argparse.Namespace) -> int | str:
    """A count, or a config path: as given by flag, or positionally (a count where it reads as one)."""
    if args.params is not None:
        return parse_count(args.params)
    if args.config is not None or Path(args.model).exists():
        return args.config or args.model
    if args.model.strip()[:1] in "0123456789+-.":
        return parse_count(args.model)
    raise PlanError(f"{args.model!r} is neither a parameter count (7e9, 1.3B, 2^24) nor a config.json path that exists")


def _budget(value: str | None, flag: str, detect) -> tuple[int | None, str]:
    if value is not None:
        return parse_bytes(value, flag), f"({flag})"
    found = detect()
    return (None, f"not detected: pass {flag}") if found is None else found


def _side(size: int | None, source: str) -> str:
    return source if size is None else f"{format_bytes(size)} {source}"


def _table(rows: list[Row]) -> str:
    headers = ["states", "master", "host GiB", "host B/param", "GPU GiB", "GPU left GiB", "fits", "CPU step"]
    body = [
        [
            r.state_precision,
            r.master_dtype,
            f"{r.host_bytes / GIB:,.2f}",
            f"{r.host_bytes_per_param:.2f}",
            f"{r.device_bytes / GIB:,.2f}",
            "?" if r.gpu_left is None else f"{r.gpu_left / GIB:,.2f}",
            fits(r),
            "" if r.step_seconds is None else f"~{seconds(r.step_seconds)} (estimate)",
        ]
        for r in rows
    ]
    return render(headers, body)


def _notes(row: Row, exact: bool, inflight: int) -> str:
    buckets = OPEN_BUCKETS + inflight
    notes = [
        f"host: master weights, both Adam moments (8-bit: codes and a float32 scale per {BLOCK}), the pinned bf16 "
        "grad/weight buffer"
        + (", the fp32 gradient accumulator" if row.accumulation else "")
        + (", the spare bf16 buffer of overlap=backward" if row.overlap == "backward" else "")
        + "; leave room for the rest of the process (data loading, the CUDA runtime's host memory).",
        f"GPU: the bf16 weights ({row.weights_bytes / GIB:,.2f} GiB) and at most {buckets} grad buckets "
        f"({row.grad_buffer_bytes / buckets / 2**20:,.0f} MiB each). Activations, the CUDA context and PyTorch's "
        "cache are yours: 'GPU left' is what remains for them.",
    ]
    if not row.accumulation:
        notes.append(
            f"With gradient accumulation (several backward passes per step) add {ACCUMULATOR_DTYPE.itemsize} B/param "
            "for the accumulator: --accumulation."
        )
    if not exact:
        notes.append(
            f"A count has no shapes: params are taken as at most a bucket each, without the {ALIGN}-element padding of "
            "each param; a param larger than a bucket (an embedding) makes its own, larger bucket. Pass --config "
            "for exact bytes."
        )
    if row.device_share:
        notes.append(
            f"--device-fraction: the GPU steps {row.device_share:.0%} of the elements (whole buckets, the first "
            f"layers'): their state takes {row.device_state_bytes / GIB:,.2f} GiB of GPU memory where it stays "
            "resident (the first row's; the others' in --json), or crosses the link each way every step where it "
            f"streams, and their grads {row.device_grads_bytes / GIB:,.2f} GiB until the step; both are in 'GPU GiB'. "
            "The CPU step estimate is the host's part."
        )
    if row.step_seconds is not None:
        notes.append(
            "CPU step: the Adam pass over host memory at the probe's pace, the time memory alone allows; with 8-bit "
            "moments, whose arithmetic sets the pace, times the factor their steps measured over it (2.0 with an fp32 "
            "master, 3.8 with a bf16 one, on 2 cores: docs/plan.md). Not in it: the grads' and weights' copies to and "
            "from the GPU."
        )
    return "\n".join(f"- {n}" for n in notes)


if __name__ == "__main__":
    sys.exit(main())
