"""The planner's tables as the command line prints them, and the FSDP2 report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Protocol

from ..quant8 import BLOCK
from .fsdp2 import FORWARD_FLOPS, FSDP2Row
from .models import ModelSpec

GIB = 2**30


class Judged(Protocol):
    @property
    def host_fits(self) -> bool | None: ...
    @property
    def gpu_fits(self) -> bool | None: ...
    @property
    def fits(self) -> bool | None: ...


def render(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A GitHub-markdown table, padded so it also reads as plain text."""
    widths = [max(len(x) for x in col) for col in zip(headers, *body)]
    lines = [[h.ljust(w) for h, w in zip(line, widths)] for line in [headers, *body]]
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join(["| " + " | ".join(lines[0]) + " |", rule, *("| " + " | ".join(x) + " |" for x in lines[1:])])


def fits(r: Judged) -> str:
    if r.fits:
        return "yes"
    short = [side for side, ok in (("host", r.host_fits), ("GPU", r.gpu_fits)) if ok is False]
    unknown = [side for side, ok in (("host", r.host_fits), ("GPU", r.gpu_fits)) if ok is None]
    return f"no ({' and '.join(short)})" if short else f"? ({' and '.join(unknown)} unknown)"


def seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def print_fsdp2(rows: list[FSDP2Row], spec: ModelSpec, sides: list[str], *, as_json: bool) -> None:
    """The FSDP2 plan as ``python -m cpu_adam.plan --fsdp2`` prints it; ``sides``: the budgets' and probe's lines."""
    if as_json:
        extra = ("rank_bytes", "host_bytes", "host_bytes_per_param", "fits")
        print(json.dumps([dataclasses.asdict(r) | {k: getattr(r, k) for k in extra} for r in rows], indent=1))
        return
    first = rows[0]
    print(
        f"model: {spec.source}, {spec.params:,} trained params; FSDP2 over {first.world_size} ranks, "
        f"{first.ranks_per_host} a host; CPUAdam steps each rank's shards in host RAM"
    )
    print("\n".join(sides).replace("host RAM:", "host RAM (one host):"))
    print()
    print(_fsdp2_table(rows))
    print()
    print(_fsdp2_notes(first))


def _fsdp2_table(rows: list[FSDP2Row]) -> str:
    headers = ["shards", "moments", "rank GiB", "B/param", "host GiB", "GPU GiB/unit", "GPU left GiB", "fits"]
    headers += ["CPU step", "behind fwd: exposed", "hidden"]
    body = [
        [
            r.shard_dtype + (" (SR)" if r.shard_dtype == "bf16" else ""),
            r.state_precision,
            f"{r.rank_bytes / GIB:,.2f}",
            f"{r.host_bytes_per_param:.2f}",
            f"{r.host_bytes / GIB:,.2f}",
            "?" if r.gpu_bytes is None else f"{r.gpu_bytes / GIB:,.2f}",
            "?" if r.gpu_left is None else f"{r.gpu_left / GIB:,.2f}",
            fits(r),
            "" if r.step_seconds is None else f"~{seconds(r.step_seconds)} (estimate)",
            "" if r.exposed_seconds is None else f"~{seconds(r.exposed_seconds)}",
            "" if r.hidden_seconds is None else f"~{seconds(r.hidden_seconds)}",
        ]
        for r in rows
    ]
    return render(headers, body)


def _fsdp2_notes(row: FSDP2Row) -> str:
    unit = (
        f"the largest unit ({row.unit_params:,} params)"
        if row.unit_params is not None
        else "unknown for a bare count: pass --unit-params (a decoder layer's params, or the embedding's if larger)"
    )
    notes = [
        f"rank: its shards of the weights and of the grads (FSDP2 moves them down in the shards' dtype), and "
        f"CPUAdam's two moments (8-bit: codes and a float32 scale per {BLOCK}); the rank holding the most, padding "
        f"included. host: the {row.ranks_per_host} ranks of one host (--ranks-per-host). Pinned memory "
        "(CPUOffloadPolicy's default) is host RAM too; leave room for the rest of each process.",
        f"GPU per unit: {unit} gathered in bf16 with the next one (prefetched), its unsharded grads in fp32 "
        "(MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)) and their shard: an estimate. "
        "Activations, the CUDA context and PyTorch's cache are yours: 'GPU left' is what remains for them.",
        "bf16 shards are the masters: CPUAdam steps them with stochastic_rounding=True; fp32 shards are the "
        "masters of a model computed in bf16 (param_dtype=bfloat16).",
        "set_requires_gradient_sync(False) (gradient accumulation without a reduce-scatter per micro-batch) keeps "
        "each unit's unsharded grads on the GPU until the last micro-batch: the whole model's, in the reduce dtype.",
    ]
    if row.step_seconds is not None:
        notes.append(
            "CPU step: every rank of a host stepping its shards at once, at this machine's probe pace (all its "
            "threads shared by the host's ranks); with 8-bit moments times the factor their steps measured over it. "
            "Not in it: FSDP2's copies of the weights up and of the grads down."
        )
        notes.append(
            f"behind fwd: the step run behind the next forward (cpu_adam.fsdp2.step_behind_forward), beside a "
            f"forward of ~{seconds(row.forward_seconds)} (2 flops a param a token at "
            f"{FORWARD_FLOPS / 1e12:.0f} TFLOP/s, the pace measured on an H200 under FSDP2 with CPU offload; "
            "--tokens, --forward-ms): exposed is what the forward waits for it, each unit's gather for its own "
            "unit; hidden runs while the GPU computes. The clip norm (before the step, a pass over the grads) "
            "is not in either."
        )
    return "\n".join(f"- {n}" for n in notes)
