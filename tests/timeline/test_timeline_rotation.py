"""A size-bounded timeline: rotated files, each a complete trace, read by the summary."""

import json
import os
import subprocess
import sys
import time

import pytest

from hvdlite.common.diagnostics.recorder import COLLECTIVE
from hvdlite.common.diagnostics.timeline_writer import ROTATED_FILES, Timeline, rotated_paths
from hvdlite.timeline import summary_of_file
from tests.runner.conftest import REPO

pytestmark = pytest.mark.timeout(60)


def feed(tl, step, names):
    t = time.monotonic()
    for n in names:
        tl.queued(n, "allreduce", t, 1024)
        tl.negotiated(n, t + 1e-4, [1] if n == names[0] else [])
        tl.span(COLLECTIVE, [n], t + 1e-4, t + 2e-4)
        tl.done(n, t + 3e-4, None)


def test_rotation_bounds_the_size_and_every_file_parses(tmp_path):
    path = tmp_path / "t.json"
    stale = tmp_path / "t.json.3"
    stale.write_text("not ours any more")  # a previous run's part: removed at start
    bound = 200 * 1024
    tl = Timeline(str(path), flush_interval_s=0.005, max_bytes=bound)
    names = [f"grad.{i}" for i in range(40)]
    steps = 0
    while steps < 400:
        feed(tl, steps, names)
        steps += 1
        if steps % 20 == 0:
            time.sleep(0.02)  # let the writer flush and rotate
    tl.close()
    files = rotated_paths(str(path))
    assert files == [f"{path}.{i}" for i in range(ROTATED_FILES, 0, -1)] + [str(path)]
    total = sum(os.path.getsize(f) for f in files)
    # the bound holds up to one flush interval's worth of events per file
    assert total < 1.5 * bound, (total, [os.path.getsize(f) for f in files])
    ops = 0
    for f in files:
        events = json.loads(open(f).read())  # each file is a complete JSON array
        rows = {
            e["tid"]: e["args"]["name"]
            for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
        }
        slices = [e for e in events if e.get("ph") == "X"]
        assert slices and all(e["tid"] in rows for e in slices), f  # rows named in-file
        ops += sum(
            1 for e in slices if e["name"] == "ALLREDUCE" and "chunk" not in e.get("args", {})
        )  # the op, not its collective
    assert events[-1]["name"] == "timeline_end"
    # older parts were dropped: fewer operations than were recorded, but all of the newest
    assert 40 <= ops < 400 * 40
    s = summary_of_file(str(path))
    assert s.files == ROTATED_FILES + 1 and sum(s.ops.values()) == ops
    assert 0 < s.waited[1][0] <= ops // 40 + 1  # grad.0 waited for rank 1
    out = subprocess.run(
        [sys.executable, "-m", "hvdlite.timeline", "summary", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert f"read from {ROTATED_FILES + 1} rotated files" in out.stdout, out.stdout


def test_no_bound_means_one_file(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), flush_interval_s=0.005)
    for step in range(50):
        feed(tl, step, ["a", "b"])
    tl.close()
    assert rotated_paths(str(path)) == [str(path)]
    assert summary_of_file(str(path)).ops == {"a": 50, "b": 50}
