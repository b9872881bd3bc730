"""benchmarks/crosshost.py runs end to end at its smallest (one rate, tiny1000, one round) on
a testbed of its own, writes its rows and targets, and leaves no namespace behind."""

import json
import os
import subprocess
import sys

import pytest

from tests.testbed import hosts as testbed_hosts

from .conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_crosshost_benchmark_smoke(tmp_path):
    try:
        testbed_hosts.check_available()
    except testbed_hosts.TestbedUnavailable as exc:
        pytest.skip(str(exc))
    out_json = tmp_path / "crosshost.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "crosshost.py"),
            "--workloads",
            "tiny1000",
            "--rates",
            "1gbit",
            "--rounds",
            "1",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--rtt-samples",
            "100",
            "--json",
            str(out_json),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "x link" in out and "round trip tbh0 <-> tbh1" in out, out[-4000:]

    data = json.loads(out_json.read_text())
    rows = {(r["setup"], r["rate"], r["workload"], r["impl"]): r for r in data["rows"]}
    want = {
        (setup, rate, "tiny1000", impl)
        for setup, rate in (("1 host", None), ("2 hosts", "1gbit"))
        for impl in ("hvdlite_fusion", "hvdlite_optimizer", "torch_flat", "memcpy_floor")
    }
    assert set(rows) == want, sorted(rows, key=str)
    for key, r in rows.items():
        assert r["iters"] >= 1 and r["ms_median"] > 0 and r["ratio_to_flat"] > 0, (key, r)
    cross = rows[("2 hosts", "1gbit", "tiny1000", "hvdlite_fusion")]
    assert cross["link_bytes_each_way"] == 1000 * 256 * 4
    assert cross["link_gbit_per_s"] > 0 and cross["link_ratio"] > 0
    opt = rows[("2 hosts", "1gbit", "tiny1000", "hvdlite_optimizer")]
    assert opt["link_bytes_each_way"] == 1000 * 256 * 4 and opt["link_ratio"] > 0
    assert rows[("1 host", None, "tiny1000", "hvdlite_fusion")]["link_bytes_each_way"] == 0
    assert data["round_trips"]["1gbit"]["median_ms"] > 0
    assert 0 < data["tcp_both_ways"]["1gbit"]["ratio"] < 1.2
    # tiny1000 is held to the one-host time; the x flat target is for the big workloads
    assert set(data["targets"]) == {"1gbit_tiny1000_vs_one_host"}, data["targets"]
    assert data["targets"]["1gbit_tiny1000_vs_one_host"]["limit_ms"] > 0
    assert [r["setup"] for r in data["runs"]] == ["1 host", "2 hosts"]
    assert all(len(r["load_start"]) == 3 and len(r["load_end"]) == 3 for r in data["runs"])
    # the benchmark's testbed is gone
    made = [h["namespace"] for h in data["meta"]["testbed"]["hosts"]] + [
        data["meta"]["testbed"]["switch"]
    ]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in made if ns in left.split()], (made, left)
