"""The launcher's side of --metrics-port without processes: the store ops, the collector."""

import json
import logging
import sys
import types

import pytest

from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.engine.message import OpType, Response
from hvdlite.common.diagnostics.metrics_counters import Counters
from hvdlite.common.net.service import ServiceError
from hvdlite.runner.cli import launch
from hvdlite.runner.store import metrics_server
from hvdlite.runner.store.metrics_inbox import MAX_SNAPSHOT_BYTES, MetricsInbox

prometheus_client = pytest.importorskip("prometheus_client")


def _header(rank, host="h", slot=0):
    return {"op": "metrics", "hostname": host, "local_rank": slot, "rank": rank}


def test_inbox_refuses_bad_snapshots():
    inbox = MetricsInbox(lambda r: None)
    with pytest.raises(ServiceError, match="hostname, local_rank and rank"):
        inbox.take_metrics({"op": "metrics", "hostname": "h"}, b"{}")
    with pytest.raises(ServiceError, match="not JSON"):
        inbox.take_metrics(_header(0), b"{nope")
    with pytest.raises(ServiceError, match="not a JSON object"):
        inbox.take_metrics(_header(0), b"[1]")
    with pytest.raises(ServiceError, match="over"):
        inbox.take_metrics(_header(0), b" " * (MAX_SNAPSHOT_BYTES + 1))
    assert inbox.snapshots() == {}


def test_straggler_line_names_the_host(caplog):
    inbox = MetricsInbox(lambda r: {1: "node7"}.get(r))
    with caplog.at_level(logging.WARNING, logger="hvdlite.runner"):
        inbox.take_straggler({"rank": 1, "text": "straggler: rank 1 was the last"})
    assert "[rank 1 on host node7]" in caplog.text
    with pytest.raises(ServiceError):
        inbox.take_straggler({"rank": "1", "text": "x"})


def _counters(ops, nbytes, rank0=False):
    c = Counters(fusion_threshold_bytes=1000)
    group = [Response(f"t{i}", OpType.ALLREDUCE, "float32", (nbytes // 4,)) for i in range(ops)]
    for r in group:
        r.nbytes = nbytes
    c.executed(group, 0.003)
    c.executed(group, 0.003)  # the same group again: its bytes are remembered
    c.negotiated(0.002)
    c.responses(ops, cached=True)
    c.responses(1, cached=False)
    if rank0:
        c.stalled = 2
        c.stragglers = types.SimpleNamespace(
            ranks=[0, 1], last_total=[1, 9], late_total_s=[0.01, 0.5], cycles_total=12
        )
    return c.snapshot()


def _families(inbox, agent=None):
    job = types.SimpleNamespace(inbox=lambda: inbox, agent=agent)
    return {f.name: f for f in metrics_server.JobCollector(job).collect()}


def test_collector_sums_ranks_and_takes_lateness_from_rank_0():
    inbox = MetricsInbox(lambda r: None)
    inbox.take_metrics(_header(0, slot=0), json.dumps(_counters(3, 100, rank0=True)).encode())
    inbox.take_metrics(_header(1, slot=1), json.dumps(_counters(3, 100)).encode())
    agent = types.SimpleNamespace(
        round=2, resets=2, hostset=types.SimpleNamespace(blacklisted={"badhost": "exited 1"})
    )
    f = _families(inbox, agent)

    def value(name, **labels):
        return sum(
            s.value
            for s in f[name].samples
            if s.name.endswith(("_total", name))
            and all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert value("hvdlite_operations", op="allreduce") == 12  # 2 ranks x 2 runs x 3
    assert value("hvdlite_bytes", op="allreduce") == 1200
    assert value("hvdlite_stalled_tensors") == 2
    assert value("hvdlite_rank_last_ready", rank="1") == 9
    assert value("hvdlite_rank_lateness_seconds", rank="1") == 0.5
    assert value("hvdlite_response_cache_hit_ratio") == pytest.approx(6 / 8)
    assert value("hvdlite_elastic_resets") == 2 and value("hvdlite_blacklisted_hosts") == 1
    hist = {
        s.labels.get("le"): s.value
        for s in f["hvdlite_negotiation_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert hist["0.001"] == 0 and hist["0.0025"] == 2 and hist["+Inf"] == 2
    fill = {s.name: s.value for s in f["hvdlite_fusion_buffer_fill_ratio"].samples}
    assert fill["hvdlite_fusion_buffer_fill_ratio_sum"] == pytest.approx(4 * 0.3)


def _spec(argv, monkeypatch, **environ):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    return launch.spec_from_args(launch.parse_args([*argv, sys.executable, "-c", "pass"]))


def test_endpoint_reads_the_flag_then_the_environment(monkeypatch):
    """The endpoint comes from the job's one validated Config: the flag over the
    launcher's environment, a malformed value refused naming where it was set."""
    assert metrics_server.endpoint(_spec(["-np", "1"], monkeypatch).tunables) is None
    spec = _spec(["-np", "1", "--metrics-port", "9000"], monkeypatch)
    assert metrics_server.endpoint(spec.tunables) == ("127.0.0.1", 9000)
    spec = _spec(
        ["-np", "1"], monkeypatch, HVDLITE_METRICS_PORT="9001", HVDLITE_METRICS_ADDRESS="0.0.0.0"
    )
    assert metrics_server.endpoint(spec.tunables) == ("0.0.0.0", 9001)
    spec = _spec(["-np", "1", "--metrics-port", "9002"], monkeypatch)
    assert metrics_server.endpoint(spec.tunables) == ("0.0.0.0", 9002)
    with pytest.raises(HvdliteConfigError, match="HVDLITE_METRICS_PORT"):
        _spec(["-np", "1"], monkeypatch, HVDLITE_METRICS_PORT="http")


@pytest.mark.timeout(60)
def test_a_busy_metrics_port_is_refused_naming_the_flag():
    import socket
    from tests.runner.conftest import run_launcher

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_launcher(
            ["-np", "2", "--metrics-port", str(port), sys.executable, "-c", "print('never')"],
            timeout=50,
        )
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--metrics-port {port}" in r.stderr and "cannot listen" in r.stderr
    assert "never" not in r.stdout
