"""The benchmarks run end to end at np=2 and write every row (so they cannot rot): allreduce.py,
transports.py and launch.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launching

REPO = Path(__file__).resolve().parent.parent
IMPLS = {
    "hvdlite_fusion",
    "hvdlite_optimizer",
    "hvdlite_nofusion",
    "hvdlite_noshm",
    "torch_per_tensor",
    "torch_per_tensor_sync",
    "torch_flat",
    "memcpy_floor",
}
WORKLOADS = {"resnet50", "bert", "tiny1000", "big64mb"}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_allreduce_benchmark_smoke(tmp_path):
    out_json = tmp_path / "allreduce.json"
    proc = launching.run(
        [
            "-np",
            "2",
            sys.executable,
            REPO / "benchmarks" / "allreduce.py",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--bert-layers",
            "1",
            "--json",
            out_json,
        ],
        timeout=110,
        pythonpath=[REPO],
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "x flat" in out, out[-4000:]  # rank 0 printed the table

    data = json.loads(out_json.read_text())
    assert data["meta"]["size"] == 2
    rows = {(r["workload"], r["impl"]): r for r in data["rows"]}
    assert set(rows) == {(w, i) for w in WORKLOADS for i in IMPLS}, sorted(rows)
    for key, r in rows.items():
        assert r["iters"] >= 1, key
        for field in (
            "ms_median",
            "ms_mean",
            "ms_min",
            "gb_per_s",
            "ratio_to_flat",
            "ratio_to_floor",
        ):
            assert r[field] > 0, (key, field, r[field])
        assert r["bytes"] > 0 and r["tensors"] >= 1, key
    assert rows[("resnet50", "torch_flat")]["tensors"] == 161
    assert rows[("resnet50", "torch_flat")]["bytes"] == 4 * 25_557_032
    assert rows[("tiny1000", "torch_flat")]["bytes"] == 1000 * 256 * 4
    assert rows[("big64mb", "torch_flat")]["bytes"] == 64 * 1024 * 1024
    assert abs(rows[("resnet50", "torch_flat")]["ratio_to_flat"] - 1.0) < 1e-9
    assert abs(rows[("bert", "memcpy_floor")]["ratio_to_floor"] - 1.0) < 1e-9
    assert rows[("bert", "hvdlite_fusion")]["paired_ratio_to_floor"] > 0
    # the optimizer rows reduce the same gradients through DistributedOptimizer's buckets
    assert rows[("resnet50", "hvdlite_optimizer")]["bytes"] == 4 * 25_557_032
    assert data["meta"]["op"] == "average"
    assert {
        "resnet50_fusion_ratio_to_flat",
        "resnet50_fusion_ratio_to_floor",
        "big64mb_fusion_ratio_to_floor",
    } <= set(data["targets"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_transports_benchmark_smoke(tmp_path):
    out_json = tmp_path / "transports.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "transports.py"),
        "--np",
        "2",
        "--workloads",
        "tiny1000",
        "--rounds",
        "1",
        "--iters",
        "1",
        "--warmup",
        "1",
        "--json",
        str(out_json),
    ]
    proc = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    table = json.loads(out_json.read_text())["table"]
    assert {(t["setup"], t["transport"]) for t in table} == {
        ("np=2, one host", "shared memory"),
        ("np=2, one host", "Gloo TCP"),
        ("np=2, one host", "MPI"),
    }
    for t in table:
        assert t["ms"] > 0 and t["x_flat"] > 0 and t["speedup_vs_per_tensor"] > 0, t
        assert t["floor_ms"] > 0 and t["x_floor"] > 0, t


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_benchmark_smoke(tmp_path):
    out_json = tmp_path / "launch.json"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "launch.py"),
            "--repeats",
            "1",
            "--json",
            str(out_json),
        ],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = {(r["work"], r["launcher"]): r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {
        ("noop", "torchrun"),
        ("noop", "hvdlite-run"),
        ("noop", "python x np"),
        ("init", "torchrun"),
        ("init", "hvdlite-run"),
    }
    for key, r in rows.items():
        assert r["s_median"] > 0 and r["x_torchrun"] > 0, (key, r)
    assert rows[("init", "torchrun")]["x_torchrun"] == 1.0
