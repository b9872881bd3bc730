"""The allreduce benchmark's opt-in rows run end to end (so the report's numbers cannot rot)."""

import json
import sys
from pathlib import Path

import pytest

from tests import launching

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.timeout(150)
def test_timeline_and_autotune_rows(tmp_path):
    out_json, trace = tmp_path / "rows.json", tmp_path / "bench_trace.json"
    proc = launching.run(
        [
            "-np",
            "2",
            sys.executable,
            REPO / "benchmarks" / "allreduce.py",
            "--workloads",
            "tiny1000",
            "--impls",
            "hvdlite_fusion,hvdlite_timeline,hvdlite_autotune",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--autotune-workload",
            "tiny1000",
            "--autotune-samples",
            "1",
            "--autotune-steps",
            "1",
            "--timeline-file",
            trace,
            "--json",
            out_json,
        ],
        timeout=140,
        pythonpath=[REPO],
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out_json.read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"hvdlite_fusion", "hvdlite_timeline", "hvdlite_autotune", "torch_flat"} <= impls
    assert {"tiny1000_timeline_overhead_ratio", "tiny1000_autotune_vs_defaults"} <= set(
        data["targets"]
    )
    # warm-up, the start values, one candidate, two confirmations
    assert data["meta"]["autotuned"]["samples"] == 5
    events = json.loads(trace.read_text())  # finished by stop_timeline
    assert any(e.get("name") == "ALLREDUCE" for e in events)
