"""benchmarks/states_quality.py --quick end to end: the table, the JSON and the plot come out and make sense."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "states_quality.py"


@pytest.mark.slow
def test_quick_run_writes_a_sane_table_json_and_plot(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "q.json", tmp_path / "q.png"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out_json.read_text())
    runs = {(r["task"], r["row"]): r for r in result["runs"]}
    summaries = {(s["task"], s["row"]): s for s in result["summaries"]}

    for task in ("lm", "mlp"):
        fp32, bf16, q8, ref = (runs[task, row] for row in ("fp32", "bf16", "8bit", "torch"))
        for r in (fp32, bf16, q8, ref):
            assert not r["error"], r
            assert r["eval_steps"] == [10, 20, 30]
            assert len(r["train_losses"]) == 30
            assert r["evals"][-1] < r["evals"][0], f"{task} {r['row']} did not learn: {r['evals']}"
            assert r["final"] == pytest.approx(sum(r["evals"][-2:]) / 2)
            assert 0.0 <= r["clipped"] <= 1.0 and r["clipped"] * 30 == pytest.approx(round(r["clipped"] * 30))
        # torch.optim.AdamW from the same init on the same batches: the same trajectory up to rounding
        assert ref["final"] == pytest.approx(fp32["final"], rel=1e-4)
        # the states really are what the rows say: 8-bit changes the trajectory, a little
        assert q8["quantized"] == 1.0 and fp32["quantized"] == 0.0 and bf16["quantized"] == 0.0
        assert q8["final"] != fp32["final"] and bf16["final"] != fp32["final"]
        assert abs(q8["final"] / fp32["final"] - 1) < 0.05
        assert summaries[task, "8bit"]["rel_mean"] == pytest.approx(q8["final"] / fp32["final"] - 1)

        bnb = runs[task, "bnb"]
        if importlib.util.find_spec("bitsandbytes") is None:
            assert bnb["error"] == "bitsandbytes not installed"
        else:
            assert not bnb["error"], bnb["error"]
            assert math.isfinite(bnb["final"]) and 0.9 < bnb["quantized"] < 1.0  # small tensors keep fp32 states
        assert runs[task, "torchao"]["error"].startswith("skipped in --quick")

    assert "| task | optimizer" in run.stdout
    assert "lm: 8-bit states" in run.stdout and "mlp: 8-bit states" in run.stdout
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot" in run.stdout
    else:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
