"""benchmarks/tiny_ops.py runs end to end at np=2 (separate and grouped steps and the flat
torch baseline), writes its rows with their ratios to the baseline and the machine's load,
and every rank's tensors hold the right averages afterwards."""

import json
import sys
from pathlib import Path

import pytest

from tests import launching

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(90)
def test_tiny_ops_benchmark_smoke(tmp_path):
    out_json = tmp_path / "tiny.json"
    proc = launching.run(
        [
            "-np",
            "2",
            sys.executable,
            REPO / "benchmarks" / "tiny_ops.py",
            "--tensors",
            "50",
            "--floats",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--json",
            out_json,
        ],
        timeout=80,
        pythonpath=[REPO],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    data = json.loads(out_json.read_text())
    assert data["np"] == 2 and data["values_ok"] is True
    assert set(data["rows"]) == {"separate", "grouped", "torch_flat"}
    for kind, row in data["rows"].items():
        assert 0 < row["min_ms"] <= row["median_ms"], (kind, row)
        assert len(row["round_medians_ms"]) == 1, (kind, row)
        assert row["x_flat"] == pytest.approx(
            row["median_ms"] / data["rows"]["torch_flat"]["median_ms"]
        )
    assert data["rows"]["torch_flat"]["x_flat"] == pytest.approx(1.0)
    assert set(data["targets"]) == {"separate_x_torch_flat"}
    assert len(data["load"]["start"]) == 3 and data["load"]["cores"] >= 1
