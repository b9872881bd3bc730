"""The timeline end to end: real launcher, two ranks, real files, a real SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hvdlite.common.diagnostics.timeline_writer import load_events
from tests import launching
from tests.runner.conftest import REPO, run_launcher

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "timeline_worker.py")


def rows(events):
    return {
        e["tid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e["tid"] > 0
    }


def slices(events, tensor):
    tids = {t for t, n in rows(events).items() if n == tensor}
    return [e for e in events if e.get("ph") == "X" and e.get("tid") in tids]


def summary(path, *extra):
    return subprocess.run(
        [sys.executable, "-m", "hvdlite.timeline", "summary", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.mark.timeout(150)
def test_timeline_file_flags_runtime_start_stop_and_summary(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r = run_launcher(
        [
            "-np",
            "2",
            "--timeline-filename",
            str(a),
            "--timeline-mark-cycles",
            "--fusion-chunk-mb",
            "0.002",
            sys.executable,
            WORKER,
            "phases",
            str(b),
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # both files were finished: each is one complete JSON array
    ev_a, ev_b = json.loads(a.read_text()), json.loads(b.read_text())
    names_a, names_b = set(rows(ev_a).values()), set(rows(ev_b).values())
    assert {"a.small0", "a.big", "a.late"} <= names_a and not any(
        n.startswith(("b.", "c.")) for n in names_a
    ), names_a
    assert {"b.small0", "b.big"} <= names_b and not any(
        n.startswith(("a.", "c.")) for n in names_b
    ), names_b

    # every phase of a fused, pipelined tensor, in order, on its own row
    phases = [e["name"] for e in slices(ev_a, "a.small5")]
    for phase in (
        "QUEUED",
        "NEGOTIATE_ALLREDUCE",
        "MEMCPY_IN_FUSION_BUFFER",
        "GLOO_ALLREDUCE",
        "MEMCPY_OUT_FUSION_BUFFER",
        "ALLREDUCE",
    ):
        assert phase in phases, phases
    assert phases.count("ALLREDUCE") == 4  # one operation per step
    # the fused response is one operation over its tensors, one slice per pipelined chunk
    fused = [e for e in ev_a if e.get("ph") == "b" and e.get("cat") == "fused"]
    assert fused and all(e["pid"] == 0 and e["tid"] == 0 for e in fused)
    assert any(len(e["args"]["tensors"]) > 1 for e in fused)
    assert len({e["args"]["chunk"] for e in fused}) > 1, "tiny chunks should pipeline"
    assert len([e for e in ev_a if e.get("ph") == "e"]) == len(fused)
    # the big tensor is reduced where it lies: a collective, no copies
    big = {e["name"] for e in slices(ev_a, "a.big")}
    assert "GLOO_ALLREDUCE" in big and "MEMCPY_IN_FUSION_BUFFER" not in big
    # rank 1 asked for a.late 0.3 s after rank 0: the negotiation names it
    [neg] = [e for e in slices(ev_a, "a.late") if e["name"].startswith("NEGOTIATE")]
    assert neg["args"]["waited_for"] == [1] and neg["dur"] > 100_000, neg
    # cycle marks only where asked for
    assert any(e.get("name") == "CYCLE_START" for e in ev_a)
    assert not any(e.get("name") == "CYCLE_START" for e in ev_b)

    out = summary(a, "--plot", str(tmp_path / "a.png"))
    assert out.returncode == 0, out.stderr
    assert "a.late" in out.stdout, out.stdout
    # one table of waiting (the lateness one), not a second measure of it beside
    assert out.stdout.count("ranks waited for") == 1, out.stdout
    table = out.stdout[out.stdout.index("ranks waited for") :].splitlines()
    assert "cycles late" in table[1] and "% of trace span" in table[1], table
    assert table[2].split()[0] == "1", table  # rank 1 was late most
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(150)
def test_timeline_survives_sigkill_of_rank_0(tmp_path):
    trace, pidfile = tmp_path / "k.json", tmp_path / "pid"
    proc = launching.start(
        ["-np", "2", "--timeline-filename", trace, sys.executable, WORKER, "forever", pidfile],
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while not (pidfile.exists() and pidfile.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        time.sleep(0.5)  # more steps, mid-run
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    text = trace.read_text()
    with pytest.raises(ValueError):
        json.loads(text)  # no closing bracket: cut short
    events = load_events(str(trace))
    done = [e for e in slices(events, "k.small0") if e["name"] == "ALLREDUCE"]
    assert len(done) >= 5, len(done)
    out = summary(trace)
    assert out.returncode == 0 and "k.small0" in out.stdout, out.stdout + out.stderr
