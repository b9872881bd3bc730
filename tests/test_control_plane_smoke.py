"""benchmarks/control_plane.py runs at a tiny size and writes the rows, fits and model it promises.

The thread harness at np=2 and 4 (real Runtime objects over tests/common/loopback.py), the
mirror harness at 2, 8 and 256, plus one real-process job at np=2 through hvdlite-run, so every
harness stays runnable."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: the control vector with the default 1,024-slot cache, at any number of ranks
VECTOR_BYTES = 352
ROW_FIELDS = (
    "vector_bytes",
    "miss_negotiation_ms",
    "miss_control_allreduce_ms",
    "rank0_miss_cycle_cpu_ms",
    "hit_control_allreduce_ms",
    "rank0_hit_cycle_cpu_ms",
    "hit_step_ms",
    "miss_step_ms",
    "lockstep_control_allreduce_ms",
    "lockstep_allgather_ms",
)


def _run(tmp_path, *args):
    out_json = tmp_path / "cp.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "control_plane.py"),
            "--quick",
            "--json",
            str(out_json),
            *args,
        ],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return json.loads(out_json.read_text()), out


def _check_row(row, harness, np_):
    assert row["harness"] == harness and row["np"] == np_, row
    assert "error" not in row, row
    for field in ROW_FIELDS:
        assert row[field] is not None and row[field] > 0, (harness, np_, field, row)
    # exact, from the control-vector layout (control_vector.py): independent of the size
    assert row["vector_bytes"] == VECTOR_BYTES
    assert row["miss_cycles"] >= 1 and row["hit_cycles"] >= 1, row
    # a negotiation either allgathered (timed, bytes counted) or was uniform (nothing moved)
    if row["uniform_negotiations"] < row["miss_cycles"]:
        assert row["miss_allgather_ms"] > 0 and row["miss_allgather_bytes"] > 0, row


@pytest.mark.timeout(90)
def test_control_plane_benchmark_thread_harness(tmp_path):
    data, out = _run(
        tmp_path, "--thread-np", "2,4", "--mirror-np", "2,8,256", "--controller-np", "2,4,8"
    )
    assert "miss negot ms" in out  # the table was printed
    rows = data["rows"]
    assert [(r["harness"], r["np"]) for r in rows] == [
        ("thread", 2),
        ("thread", 4),
        ("mirror", 2),
        ("mirror", 8),
        ("mirror", 256),
    ]
    for r in rows:
        if r["harness"] == "thread":
            _check_row(r, "thread", r["np"])
        else:  # no transport: no lockstep columns, but the same per-cycle work
            assert "error" not in r, r
            assert r["vector_bytes"] == VECTOR_BYTES
            # the mirror's peers ask for what rank 0 asks for: every negotiation is uniform
            assert r["uniform_negotiations"] == r["miss_cycles"] >= 1, r
            assert r["miss_allgather_bytes"] == 0 and r["miss_allgather_ms"] is None, r
            assert r["rank0_miss_cycle_cpu_ms"] > 0 and r["rank0_hit_cycle_cpu_ms"] > 0, r
    assert [c["np"] for c in data["controller"]] == [2, 4, 8]
    for c in data["controller"]:
        assert c["requests"] == 16 * c["np"] and c["decode_ingest_cpu_ms"] > 0
        assert c["uniform_cpu_ms"] > 0
    fit = data["fits"]["controller:decode_ingest_cpu_ms"]
    assert set(fit["predict"]) == {"256", "1024"} and fit["preferred"] in ("linear", "power")
    # the mirror harness measured 256 directly: it sits next to the prediction from 2 and 8
    mirror_fit = data["fits"].get("mirror:rank0_miss_cycle_cpu_ms")
    assert mirror_fit is None or "measured" in mirror_fit["predict"]["256"]
    model = {m["np"]: m for m in data["model"]}
    assert model[1024]["hvdlite_vector_bytes"] == VECTOR_BYTES
    assert model[1024]["ring_sequential_hops"] == 2046
    assert model[1024]["recursive_doubling_rounds"] == 10


@pytest.mark.timeout(120)
def test_control_plane_benchmark_real_processes(tmp_path):
    data, _ = _run(
        tmp_path,
        "--thread-np",
        "",
        "--mirror-np",
        "",
        "--process-np",
        "2",
        "--controller-np",
        "",
        "--run-timeout",
        "90",
    )
    (row,) = data["rows"]
    _check_row(row, "process", 2)
    assert row["stopped_cleanly"] is True
