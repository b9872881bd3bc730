"""benchmarks/slow_links.py runs end to end at its smallest (one rate, a one-layer model,
sync and DiLoCo with H = 10) on a testbed of its own: rows of the issue's shape, the target
from sync's own run, DiLoCo's link carrying several times fewer bytes per step, a plot, and
no namespace left behind."""

import json
import os
import subprocess
import sys

import pytest

from tests.testbed import hosts as testbed_hosts

from .conftest import REPO

KEYS = {
    "method",
    "link_mbit",
    "seconds_to_target",
    "final_val_loss",
    "bytes_per_step",
    "utilisation",
}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_slow_links_benchmark_smoke(tmp_path):
    try:
        testbed_hosts.check_available()
    except testbed_hosts.TestbedUnavailable as exc:
        pytest.skip(str(exc))
    before = set(_namespaces())
    out_json, out_png = tmp_path / "slow_links.json", tmp_path / "slow_links.png"
    train = "--width 64 --layers 1 --eval-every 5 --corpus-bytes 200000 --val-windows 16"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "slow_links.py"),
            "--rates",
            "100mbit",
            "--methods",
            "diloco-h10",
            "--target-steps",
            "10",
            "--budget-factor",
            "3",
            f"--train-args={train}",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "| 100 Mbit/s | diloco-h10 |" in out, out[-4000:]
    data = json.loads(out_json.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"sync", "diloco-h10"}, sorted(rows)
    sync, diloco = rows["sync"], rows["diloco-h10"]
    for r in rows.values():
        assert KEYS <= set(r) and r["link_mbit"] == 100.0, r
        assert 0 < r["utilisation"] <= 1 and r["final_val_loss"] < 5.6, r  # ln 256 = 5.55
    assert sync["steps"] == 10 and sync["seconds_to_target"] == sync["train_seconds"]
    assert sync["target_loss"] == sync["final_val_loss"]
    # DiLoCo sends its parameters once every 10 steps instead of gradients every step
    assert sync["bytes_per_step"] > 4 * diloco["bytes_per_step"] > 0, (sync, diloco)
    assert diloco["steps"] % 10 == 0 and diloco["train_seconds"] >= 2.9 * sync["train_seconds"]
    assert set(data["targets"]) >= {"100mbit_fewer_bytes_x", "100mbit_utilisation"}
    assert out_png.stat().st_size > 1000
    new = set(_namespaces()) - before
    assert not new, f"the benchmark left namespaces behind: {sorted(new)}"


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(testbed_hosts.PREFIX)]
