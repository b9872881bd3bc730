"""The flight recorder: its ring, its dumps, and the doctor reading real jobs' dumps."""

import json
import os
import subprocess
import sys
import time

import pytest

from hvdlite.common.diagnostics import flight_recorder as fr
from hvdlite.common.engine.message import OpType, Request, Response
from hvdlite.common.engine.tensor_queue import Entry, Handle
from hvdlite.timeline import doctor
from tests import launching
from tests.runner.conftest import REPO, run_launcher

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "flight_worker.py")


def entry(name, shape=(4,), t=1.0):
    e = Entry(Request(name, OpType.ALLREDUCE, "float32", shape), None, None, Handle(1), 0)
    e.enqueued_at = t
    return e


class FakeRuntime:
    """What a dump asks a live runtime: its pending operations."""

    flight_key = "global"

    def __init__(self, pending):
        self.pending = pending

    def flight_pending(self):
        return self.pending


@pytest.mark.timeout(10)
def test_ring_keeps_the_last_n_and_dumps_them_with_the_pending_ones(tmp_path):
    rec = fr.FlightRecorder(3, str(tmp_path / "d"), rank=1, size=2, hostname="h", job_id="j")
    now = time.monotonic()
    es = [entry(f"t{i}", t=now - 1.0) for i in range(5)]
    resp = Response("t3", OpType.ALLREDUCE)
    resp.waited_for = [0]
    rec.completed("global", 7, [Response("t0", OpType.ALLREDUCE)], [(es[0], None, None)])
    rec.completed("global", 8, [Response("t1", OpType.ALLREDUCE)], [(es[1], None, None)])
    rec.completed(
        "global",
        9,
        [Response("t2", OpType.ALLREDUCE), resp],
        [(es[2], None, None), (es[3], None, None)],
    )
    rec.failed("global", [es[4]], RuntimeError("boom"))
    # whole groups are dropped while the rest hold 3 operations
    assert rec.count == 3 and rec.appended == 5 and len(rec.groups) == 2
    pending = entry("late", shape=(2, 3), t=now - 0.5)
    runtime = FakeRuntime([("negotiated", pending, -1)])
    rec.watch(runtime)
    path = rec.dump("asked")
    assert path == str(tmp_path / "d" / "flight-rank1.json")
    data = fr.load(path)
    assert (data["rank"], data["size"], data["reason"], data["appended"]) == (1, 2, "asked", 5)
    ops = {o["name"]: o for o in data["ops"]}
    assert [o["name"] for o in data["ops"]] == ["t2", "t3", "t4", "late"]
    assert ops["t3"]["state"] == "done" and ops["t3"]["cycle"] == 9
    assert ops["t3"]["waited_for"] == [0] and ops["t3"]["shape"] == [4]
    assert ops["t3"]["op"] == "allreduce" and 0.9 < ops["t3"]["duration_s"] < 5
    assert ops["t4"]["state"] == "failed" and ops["t4"]["error"] == "boom"
    assert ops["t4"]["cycle"] == -1
    assert ops["late"]["state"] == "negotiated" and ops["late"]["shape"] == [2, 3]
    assert abs(ops["late"]["submitted"] - (time.time() - 0.5)) < 2
    with pytest.raises(ValueError, match="not an hvdlite flight-recorder dump"):
        (tmp_path / "x.json").write_text("{}")
        fr.load(str(tmp_path / "x.json"))


def _op(name, state="done", cycle=1, shape=(4,), t=0.0, waited=()):
    return {
        "name": name,
        "op": "allreduce",
        "dtype": "float32",
        "shape": list(shape),
        "process_set": "global",
        "submitted": t,
        "cycle": cycle,
        "state": state,
        "duration_s": 0.1,
        "waited_for": list(waited),
        "error": None,
    }


def _dump(rank, ops, appended=None):
    return {
        "rank": rank,
        "size": 2,
        "hostname": "h",
        "pid": 1,
        "job_id": "j",
        "reason": "r",
        "dumped_at": 0.0,
        "capacity": 100,
        "appended": appended or len(ops),
        "ops": ops,
    }


@pytest.mark.timeout(10)
def test_doctor_on_synthetic_dumps():
    # the same name in earlier steps completed on both; rank 1 never reached the last one
    r0 = [
        _op("a", cycle=1, waited=[1]),
        _op("b", cycle=2),
        _op("a", cycle=3, waited=[1]),
        _op("b", state="queued", cycle=-1, t=5.0),
    ]
    r1 = [
        _op("a", cycle=1, waited=[1]),
        _op("b", cycle=2),
        _op("a", cycle=3, waited=[1]),
        _op("c", state="queued", cycle=-1, t=5.1),
    ]
    out = doctor.diagnose([_dump(0, r0), _dump(1, r1)])
    text = "\n".join(out)
    assert out[1].startswith("first divergence: missing op: tensor 'b'"), text
    assert "submitted by ranks [0] but never by ranks [1]" in out[1]
    assert "rank 1 was instead at: tensor 'c'" in text
    assert "rank 1 was the last to submit in 2 of 3 completed operations" in text
    # all agree and completed: says so
    assert "no divergence found" in doctor.diagnose([_dump(0, r0[:3]), _dump(1, r1[:3])])[-2]
    # allgather's first dimension may differ; allreduce's may not
    g0, g1 = (
        dict(_op("g", shape=(3, 2)), op="allgather"),
        dict(_op("g", shape=(5, 2)), op="allgather"),
    )
    assert "no divergence found" in doctor.diagnose([_dump(0, [g0]), _dump(1, [g1])])[1]
    out = doctor.diagnose([_dump(0, [_op("m", shape=(3, 2))]), _dump(1, [_op("m")])])
    assert "rank 0 allreduce float32 [3, 2], rank 1 allreduce float32 [4]" in out[1], out


def _doctor(path):
    return subprocess.run(
        [sys.executable, "-m", "hvdlite.timeline", "doctor", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.mark.timeout(90)
def test_shape_mismatch_is_diagnosed_from_the_dumps(tmp_path):
    d = tmp_path / "flight"
    r = run_launcher(
        ["-np", "2", "--flight-recorder-dir", str(d), sys.executable, WORKER, "mismatch"],
        timeout=80,
    )
    assert r.returncode != 0, r.stdout + r.stderr
    assert f"flight recorder dumps (one file per rank, on each rank's host): {d}" in r.stderr
    assert sorted(os.listdir(d)) == ["flight-rank0.json", "flight-rank1.json"]
    out = _doctor(d)
    assert out.returncode == 0, out.stderr
    first = [line for line in out.stdout.splitlines() if line.startswith("first divergence")]
    assert first == [
        "first divergence: tensor 'grad.fc' (process set global, cycle "
        f"{first[0].split('cycle ')[1].split(')')[0]}) was submitted differently: "
        "rank 0 allreduce float32 [4], rank 1 allreduce float32 [5]"
    ], out.stdout
    # the good steps before it are in the dumps, completed
    ops = json.loads((d / "flight-rank1.json").read_text())["ops"]
    assert [o["state"] for o in ops if o["name"] == "grad.conv"] == ["done"] * 3


@pytest.mark.timeout(90)
def test_missing_op_is_diagnosed_from_the_dumps(tmp_path):
    d = tmp_path / "flight"
    r = run_launcher(
        [
            "-np",
            "2",
            "--flight-recorder-dir",
            str(d),
            "--stall-check-warning-time-seconds",
            "1",
            "--stall-check-shutdown-time-seconds",
            "2",
            sys.executable,
            WORKER,
            "skip",
        ],
        timeout=80,
    )
    assert r.returncode != 0, r.stdout + r.stderr
    out = _doctor(d)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        "missing op: tensor 'grad.fc' (allreduce float32 [4], process set global) was "
        "submitted by ranks [0] but never by ranks [1]"
    ) in out.stdout, out.stdout
    assert "rank 1 was instead at: tensor 'grad.next' (allreduce float32 [2])" in out.stdout
    assert any(
        line.startswith("never completed: tensor 'grad.fc'") and "on rank 0" in line
        for line in lines
    ), out.stdout


@pytest.mark.timeout(60)
def test_size_zero_turns_the_recorder_off(tmp_path):
    d = tmp_path / "flight"
    r = run_launcher(
        [
            "-np",
            "2",
            "--flight-recorder-size",
            "0",
            "--flight-recorder-dir",
            str(d),
            sys.executable,
            WORKER,
            "mismatch",
        ],
        timeout=50,
    )
    assert r.returncode != 0 and "mismatched shape" in r.stderr, r.stdout + r.stderr
    assert not d.exists() and "flight recorder dumps" not in r.stderr


@pytest.mark.timeout(10)
@pytest.mark.timeout(60)
def test_no_flight_recorder_line_when_no_rank_ran_the_runtime(tmp_path):
    """A failed job whose ranks never started hvdlite's runtime (an import error, a plain
    torch.distributed program) wrote no dump: the launcher does not talk about one."""
    r = launching.run(
        ["-np", "2", sys.executable, "-c", "import no_such_module_here"],
        timeout=50,
        cwd=str(tmp_path),
    )
    assert r.returncode != 0 and "No module named 'no_such_module_here'" in r.stderr, r.stderr
    assert "flight recorder" not in r.stderr, r.stderr


def test_dump_directory_is_private_and_a_foreign_one_is_refused(tmp_path):
    rec = fr.FlightRecorder(4, str(tmp_path / "mine"))
    rec.completed("global", 1, [], [(entry("a"), None, None)])
    path = rec.dump("asked")
    assert os.stat(tmp_path / "mine").st_mode & 0o777 == 0o700 and os.path.exists(path)
    os.symlink(tmp_path / "mine", tmp_path / "link")
    rec.directory = str(tmp_path / "link")
    with pytest.raises(OSError, match="not a directory of this user"):
        rec.dump("asked")


@pytest.mark.timeout(10)
def test_a_runtime_reports_what_is_pending(tmp_path):
    from hvdlite.common.backend.local import LocalBackend
    from hvdlite.common.config import Config
    from hvdlite.common.engine.runtime import Runtime

    config = Config(flight_recorder_dir=str(tmp_path))
    rec = fr.configure(config)
    try:
        runtime = Runtime(config, LocalBackend(config))  # never started: nothing drains
        runtime.enqueue([entry("stuck", shape=(3,), t=time.monotonic())])
        data = rec.snapshot("asked")
        assert [(o["name"], o["state"], o["shape"]) for o in data["ops"]] == [
            ("stuck", "queued", [3])
        ]
        runtime.backend.close()
    finally:
        fr.configure(config.replace(flight_recorder_size=0))
