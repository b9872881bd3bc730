"""--autotune end to end: parameters change, every rank switches in the same cycle, results
stay exact (the worker checks each), the best is kept, and the CSV logs every sample."""

import csv
import json
import os
import sys

import pytest

from tests.runner.conftest import run_launcher

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "autotune_worker.py")


@pytest.mark.timeout(180)
def test_autotune_changes_parameters_on_every_rank_alike(tmp_path):
    out, log = tmp_path / "out", tmp_path / "tune.csv"
    r = run_launcher(
        [
            "-np",
            "2",
            "--autotune",
            "--autotune-log-file",
            str(log),
            "--autotune-warmup-samples",
            "1",
            "--autotune-steps-per-sample",
            "2",
            "--autotune-bayes-opt-max-samples",
            "4",
            "--autotune-gaussian-process-noise",
            "0.5",
            sys.executable,
            WORKER,
            str(out),
        ],
        timeout=160,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = [json.loads((tmp_path / f"out.{k}").read_text()) for k in (0, 1)]
    assert res[0]["steps"] == res[1]["steps"] < 600, "the tuner never finished"
    # warm-up, the starting parameters, 4 candidates, 3 confirmations, then the best
    assert res[0]["samples"] == 1 + 1 + 4 + 3
    switches = res[0]["switches"]
    assert len(switches) == res[0]["samples"]  # the first sample runs on the start values
    assert switches == res[1]["switches"], (
        "ranks switched in different cycles or to different parameters"
    )
    distinct = {json.dumps(s[1], sort_keys=True) for s in switches}
    assert len(distinct) >= 3, distinct
    assert res[0]["final"] == res[1]["final"] == res[0]["best"] == switches[-1][1]
    with open(log) as f:
        rows = list(csv.DictReader(f))
    assert [row["kind"] for row in rows] == (
        ["warmup", "initial"] + ["bayes"] * 4 + ["confirm"] * 3 + ["best"]
    )
    assert all(float(row["score_bytes_per_s"]) > 0 for row in rows)
    assert all(int(row["steps"]) == 2 for row in rows[:-1])
    best = rows[-1]
    assert int(best["fusion_threshold_bytes"]) == res[0]["best"]["fusion_threshold_bytes"]
