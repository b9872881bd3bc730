"""``hvdlite-run --metrics-port PORT``: every rank's counters as Prometheus metrics.

The launcher serves ``/metrics`` with ``prometheus_client``'s own HTTP server; each scrape
turns the newest snapshots the ranks sent to the store (``metrics_inbox``) and what the
job agent knows (round, resets, blacklist) into metric families, so nothing is counted
twice and nothing runs between scrapes.  Counters are sums over every slot that ever
reported (a restarted worker starts its own from zero, which Prometheus's ``rate()``
treats as a reset); gauges use only the snapshots of the last few seconds.

The endpoint is unauthenticated and read-only; it listens on 127.0.0.1 unless
``--metrics-address`` says otherwise (see SECURITY.md).
"""

import logging
import time
from typing import Dict, Iterable, List, Optional, Tuple

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.diagnostics.metrics_counters import BUCKETS_S

log = logging.getLogger("hvdlite.runner")

#: a snapshot older than this no longer counts for gauges (its rank has gone quiet)
FRESH_S = 5.0


def endpoint(config: cfg.Config) -> Optional[Tuple[str, int]]:
    """(address, port) the launcher serves metrics on (``--metrics-port`` /
    ``--metrics-address``, already validated in the job's ``Config``); None when off."""
    return (config.metrics_address, config.metrics_port) if config.metrics_port else None


class JobCollector:
    """A ``prometheus_client`` collector over one job: ``job.inbox()`` (the snapshots the
    ranks sent) and ``job.agent`` are read at each scrape."""

    def __init__(self, job):
        self._job = job

    def collect(self) -> Iterable:
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, SummaryMetricFamily)
        inbox = self._job.inbox()
        snaps = list(inbox.snapshots().values()) if inbox is not None else []
        now = time.monotonic()
        fresh = [s for s in snaps if now - s["at"] <= FRESH_S]
        data = [s["data"] for s in snaps]

        ops = CounterMetricFamily("hvdlite_operations", "tensors reduced, gathered, ... by "
                                  "all ranks, per operation", labels=["op"])
        nbytes = CounterMetricFamily("hvdlite_bytes", "bytes of those tensors (each rank's "
                                     "input), per operation", labels=["op"])
        for op, total in _sum_maps(data, "ops").items():
            ops.add_metric([op], total)
        for op, total in _sum_maps(data, "bytes").items():
            nbytes.add_metric([op], total)
        yield ops
        yield nbytes
        for key, what in (("negotiation", "time from a cycle's start to the agreement of all "
                                          "ranks (with the request exchange), per rank "
                                          "and cycle with work"),
                          ("collective", "time of one (fused) collective, per rank")):
            hist = HistogramMetricFamily(f"hvdlite_{key}_seconds", what)
            hist.add_metric([], _buckets(data, key), sum(d.get(f"{key}_s", 0.0) for d in data))
            yield hist
        fill = SummaryMetricFamily("hvdlite_fusion_buffer_fill_ratio",
                                   "bytes of each fused allreduce over the fusion threshold")
        fill.add_metric([], sum(d.get("fused_groups", 0) for d in data),
                        sum(d.get("fill_sum", 0.0) for d in data))
        yield fill
        hits = sum(d.get("cache_hits", 0) for d in data)
        misses = sum(d.get("cache_misses", 0) for d in data)
        yield CounterMetricFamily("hvdlite_response_cache_hits", "responses executed from "
                                  "the response cache (no negotiation)", value=hits)
        yield CounterMetricFamily("hvdlite_response_cache_misses", "responses that needed a "
                                  "full negotiation", value=misses)
        yield GaugeMetricFamily("hvdlite_response_cache_hit_ratio", "hits over all responses "
                                "since the start", value=hits / (hits + misses)
                                if hits + misses else 0.0)
        yield GaugeMetricFamily("hvdlite_stalled_tensors", "tensors some ranks submitted and "
                                "others have not for longer than the stall warning time",
                                value=max([s["data"].get("stalled", 0) for s in fresh],
                                          default=0))
        yield GaugeMetricFamily("hvdlite_ranks_reporting", "ranks whose counters arrived in "
                                f"the last {FRESH_S:g}s", value=len(fresh))
        yield from self._lateness(fresh, CounterMetricFamily)
        yield from self._agent(CounterMetricFamily, GaugeMetricFamily)

    @staticmethod
    def _lateness(fresh: List[dict], counter) -> Iterable:
        zero = [s["data"] for s in sorted(fresh, key=lambda s: -s["at"]) if s["rank"] == 0]
        last = counter("hvdlite_rank_last_ready", "completing cycles in which this rank was "
                       "the last to be ready", labels=["rank"])
        late = counter("hvdlite_rank_lateness_seconds", "time the other ranks waited for this "
                       "rank", labels=["rank"])
        cycles = counter("hvdlite_completing_cycles", "cycles that completed operations (the "
                         "straggler report's denominator)",
                         value=zero[0].get("completing_cycles", 0) if zero else 0)
        if zero:
            for rank, count in sorted(zero[0].get("last_ready", {}).items(), key=_by_int):
                last.add_metric([rank], count)
            for rank, secs in sorted(zero[0].get("lateness_s", {}).items(), key=_by_int):
                late.add_metric([rank], secs)
        return [last, late, cycles]

    def _agent(self, counter, gauge) -> Iterable:
        agent = self._job.agent
        if agent is None:
            return []
        try:
            blacklisted = len(agent.hostset.blacklisted)
        except RuntimeError:          # changed while read (the agent's thread): next scrape
            blacklisted = 0
        return [gauge("hvdlite_elastic_round", "the newest rendezvous round (0: the first)",
                      value=max(agent.round, 0)),
                counter("hvdlite_elastic_resets", "rounds published after the first",
                        value=agent.resets),
                gauge("hvdlite_blacklisted_hosts", "hosts and slots kept out of the job now",
                      value=blacklisted)]


def _by_int(item) -> int:
    try:
        return int(item[0])
    except ValueError:
        return -1


def _sum_maps(data: List[dict], key: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for d in data:
        for name, value in (d.get(key) or {}).items():
            if isinstance(value, (int, float)):
                out[str(name)] = out.get(str(name), 0) + value
    return out


def _buckets(data: List[dict], key: str) -> List[Tuple[str, float]]:
    """Cumulative (le, count) pairs from the ranks' per-bucket counts."""
    counts = [0] * (len(BUCKETS_S) + 1)
    for d in data:
        for i, c in enumerate((d.get(key) or [])[:len(counts)]):
            counts[i] += c if isinstance(c, (int, float)) else 0
    out, total = [], 0
    for bound, c in zip(list(BUCKETS_S) + [float("inf")], counts):
        total += c
        out.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return out


class MetricsServer:
    """The running endpoint; :meth:`stop` closes it."""

    def __init__(self, httpd, thread, address: Tuple[str, int]):
        self._httpd = httpd
        self._thread = thread
        self.address = address

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


def serve(address: Tuple[str, int], job) -> MetricsServer:
    """Serve ``job``'s metrics at ``http://address/metrics``.

    Raises:
        HvdliteConfigError: prometheus_client is not installed, or the port cannot be
            bound (names the flag).
    """
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise HvdliteConfigError(
            "--metrics-port needs the prometheus_client package (pip install "
            "prometheus_client; make install installs it)") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(job))
    host, port = address
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise HvdliteConfigError(f"--metrics-port {port} / --metrics-address {host}: cannot "
                                 f"listen there ({exc})") from None
    log.info("metrics of every rank at http://%s:%d/metrics", host, port)
    return MetricsServer(httpd, thread, (host, httpd.server_address[1]))
