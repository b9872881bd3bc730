"""The straggler report and ``--metrics-port`` end to end: real launcher, two ranks."""

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from hvdlite.runner.starters.mpiexec import find_mpiexec
from tests import launching
from tests.runner.conftest import free_port, run_launcher, worker

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

WORKER = worker("monitoring_worker.py")
PROMETHEUS = shutil.which("prometheus")


def _launch(args):
    return launching.start(args, stderr=subprocess.STDOUT)


def _get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _scrape(port: int):
    """{family name: family} of one scrape, or None while the endpoint is not up."""
    try:
        text = _get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return None
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families, name: str) -> float:
    return sum(s.value for s in families[name].samples)


@pytest.mark.timeout(90)
def test_straggler_warning_names_the_rank_that_sleeps_each_step():
    r = run_launcher(
        ["-np", "2", "--straggler-window-seconds", "1", sys.executable, WORKER, "straggler"],
        timeout=80,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "straggler" in ln]
    assert lines, r.stderr
    assert all(
        "rank 1 was the last to be ready" in ln and "[rank 1 on host localhost]" in ln
        for ln in lines
    ), lines
    # rate-limited: one line per REPEAT_AFTER_WINDOWS windows, the job lasts about 3
    assert len(lines) == 1, lines


@pytest.mark.timeout(90)
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_straggler_warning_under_mpi_reaches_the_launcher():
    # under --mpi rank 0 sends the line to the launcher's report store, which prints it
    r = run_launcher(
        [
            "-np",
            "2",
            "--mpi",
            "--straggler-window-seconds",
            "1",
            sys.executable,
            WORKER,
            "straggler",
        ],
        timeout=80,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "straggler" in ln]
    assert len(lines) == 1 and "rank 1 was the last to be ready" in lines[0], lines
    assert "[rank 1]" in lines[0] and "could not be told" not in lines[0], lines


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "transport",
    [
        "gloo",
        pytest.param(
            "mpi", marks=pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
        ),
    ],
)
def test_metrics_endpoint_during_a_stall_shows_the_stalled_tensor(transport):
    port = free_port()
    proc = _launch(
        [
            "-np",
            "2",
            f"--{transport}",
            "--metrics-port",
            str(port),
            "--stall-check-warning-time-seconds",
            "1",
            sys.executable,
            WORKER,
            "stall",
            "6",
        ]
    )
    try:
        deadline = time.monotonic() + 40
        families = None
        while time.monotonic() < deadline and proc.poll() is None:
            families = _scrape(port)
            if families and _value(families, "hvdlite_stalled_tensors") > 0:
                break
            time.sleep(0.3)
        assert families is not None, "the metrics endpoint never answered"
        assert _value(families, "hvdlite_stalled_tensors") > 0, sorted(families)
        ours = [n for n in families if n.startswith("hvdlite_")]
        assert len(ours) >= 5, ours
        assert _value(families, "hvdlite_ranks_reporting") == 2
        assert _value(families, "hvdlite_operations") >= 40  # 20 warm-up steps x 2 ranks
        assert _value(families, "hvdlite_bytes") >= 40 * 4000
        out, _ = proc.communicate(timeout=40)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Debian's prometheus package is not "
    "installed (tests/setup_system.sh installs it as root)",
)
def test_a_real_prometheus_server_scrapes_the_job(tmp_path):
    port, prom_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: hvdlite\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{port}']\n"
    )
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prom.log", "wb"),
    )
    job = _launch(["-np", "2", "--metrics-port", str(port), sys.executable, WORKER, "stall", "6"])
    query = urllib.parse.quote('hvdlite_operations_total{op="allreduce"}')
    try:
        deadline = time.monotonic() + 60
        seen = 0.0
        while time.monotonic() < deadline and seen < 40:
            time.sleep(1.0)
            try:
                answer = _get(f"http://127.0.0.1:{prom_port}/api/v1/query?query={query}")
            except OSError:
                continue
            result = json.loads(answer)["data"]["result"]
            seen = float(result[0]["value"][1]) if result else 0.0
        # the series Prometheus stored holds the 20 warm-up steps of both ranks
        assert seen >= 40, (tmp_path / "prom.log").read_text()[-2000:]
        out, _ = job.communicate(timeout=40)
        assert job.returncode == 0, out
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
        prom.terminate()  # by its pid; it was started here
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
