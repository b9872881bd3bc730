"""The timeline's per-rank lateness table, from synthetic traces."""

import json
import subprocess
import sys

import pytest

from hvdlite.timeline import lateness
from tests.runner.conftest import REPO, run_launcher, worker


def _late(rank, ms, ts):
    return {
        "name": "LATE",
        "ph": "i",
        "s": "p",
        "pid": 0,
        "tid": 0,
        "ts": ts,
        "args": {"rank": rank, "ms": ms},
    }


def test_late_events_give_the_table(tmp_path):
    events = [_late(1, 40.0, 1e5 * i) for i in range(10)] + [_late(2, 5.0, 1e6)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    text = lateness.report(str(path))
    rows = [ln.split() for ln in text.splitlines()[2:]]
    assert rows[0][:4] == ["1", "10", "400.00", "40.00"], text
    assert rows[1][:4] == ["2", "1", "5.00", "5.00"], text
    assert "from LATE events" in text


def test_the_wait_at_start_up_is_told_apart_not_blamed(tmp_path):
    """Rank 0 reached the first collective 375 ms after rank 1 (it was still starting):
    a wait that began before the trace did is start-up skew, said below the table."""
    op = {"name": "ALLREDUCE", "ph": "X", "pid": 0, "tid": 1, "ts": 1000.0, "dur": 500.0}
    events = [op, _late(0, 375.0, 20_000.0)] + [_late(1, 8.0, 1e5 * i) for i in range(1, 6)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    text = lateness.report(str(path))
    rows = [ln.split() for ln in text.splitlines()[2:] if ln.startswith("  ")]
    assert [r[:3] for r in rows] == [["1", "5", "40.00"]], text
    assert "the others waited 375.00 ms for rank 0 (start-up" in text, text


def test_negotiations_are_the_fallback_and_plot_falls_back_to_text(tmp_path, monkeypatch):
    events = [
        {
            "name": "NEGOTIATE_ALLREDUCE",
            "ph": "X",
            "pid": 0,
            "tid": 1,
            "ts": 0,
            "dur": 3000.0,
            "args": {"waited_for": [3]},
        }
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    monkeypatch.setattr(lateness, "plot", lambda per, p: False)  # no matplotlib
    text = lateness.report(str(path), str(tmp_path / "s.png"))
    assert "from negotiations" in text and "#" in text and "text bars" in text
    assert text.splitlines()[2].split()[:3] == ["3", "1", "3.00"]


def test_no_late_rank_says_so(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("[]")
    assert "no rank kept the others waiting" in lateness.report(str(path))


@pytest.mark.timeout(90)
def test_a_job_with_a_slow_rank_writes_late_events_the_summary_tabulates(tmp_path):
    trace = tmp_path / "trace.json"
    r = run_launcher(
        [
            "-np",
            "2",
            "--timeline-filename",
            str(trace),
            sys.executable,
            worker("monitoring_worker.py"),
            "straggler",
        ],
        timeout=80,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = subprocess.run(
        [sys.executable, "-m", "hvdlite.timeline", "summary", str(trace), "--top", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    table = out.stdout[out.stdout.index("ranks waited for (from LATE events") :]
    rows = [ln.split() for ln in table.splitlines()[2:]]
    # rank 1 sleeps 50 ms before each of its 50 steps: late in most, ~45 ms each
    assert rows[0][0] == "1" and int(rows[0][1]) >= 40, table
    assert 30.0 <= float(rows[0][3]) <= 80.0, table


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    """``summary --plot`` where matplotlib is missing: one line naming what to install, exit
    code 2, no traceback (the tables are still printed first)."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps([_late(1, 40.0, 1e5)]))
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from hvdlite.timeline.__main__ import main\n"
        f"sys.exit(main(['summary', {str(path)!r}, '--plot', {str(tmp_path / 'p.png')!r}]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(REPO)
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'hvdlite[plot]'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "text bars" in r.stdout, r.stdout
