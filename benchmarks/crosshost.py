#!/usr/bin/env python
"""Allreduce between two real hosts over a shaped link: hvdlite against raw Gloo.

Needs root: it builds the namespaced testbed of ``tests/testbed`` (two hosts ``tbh0`` and
``tbh1``, each a network namespace with its own address and sshd, linked through a bridge in a
third namespace), so the bytes between hosts cross a real veth link that ``tc tbf`` limits to a
given rate in both directions, and nothing else on the machine is slowed::

    python benchmarks/crosshost.py [--rates 1gbit,10gbit] [--workloads resnet50,bert,tiny1000]
        [--bert-layers 2] [--rounds 3] [--iters N] [--json FILE]

For each rate in ``--rates`` it shapes both hosts' links and runs ``benchmarks/allreduce.py``
once, through ``hvdlite-run -np 4 -H tbh0:2,tbh1:2`` started on ``tbh0`` (two ranks per host:
shared memory inside a host, TCP between the hosts), with ``hvdlite_fusion``,
``hvdlite_optimizer`` (DistributedOptimizer's gradient exchange) and the raw
torch.distributed baselines (``torch_flat``: one flat Gloo allreduce of all the bytes; Gloo's
ring over the 4 ranks crosses the link twice).  Once, unshaped, it runs the same workloads on
one host (``-np 2 -H tbh0:2``; ``--one-host-slots``): the one-host time of the tiny ops.  Per
rate it also times a 1-byte TCP ping-pong between the hosts (median of ``--rtt-samples``) and
what one TCP connection carries each way at once (the most ``x link`` can be).  The jobs run
with ``--no-paired`` unless ``--paired`` is given.

Link bytes: an allreduce of B bytes between H hosts, done hierarchically (reduce inside each
host, then reduce-scatter + allgather of the host sums across hosts), must carry 2(H-1)/H * B
bytes through each host's link in each direction: B for H = 2.  That B is what the ``link
Gbit/s`` column divides by the step time, for every row, so the column compares
implementations on the same work (a ring over the 4 ranks, as ``torch_flat`` runs, actually
moves 1.5 B each way over the link).  ``x link`` is that over the shaped rate.

Targets (pass/fail, in the table and ``--json``):

* ``hvdlite_fusion`` and ``hvdlite_optimizer`` on resnet50 and bert: link bandwidth >= 0.90 of
  the link rate;
* the same rows / ``torch_flat`` < 1 on resnet50 and bert (the ``x flat`` column shows it
  for tiny1000 too, where ``torch_flat`` reduces the 1000 tensors pre-flattened into one);
* tiny1000 across hosts <= 2 x its one-host time + one round trip per negotiation cycle (the
  cycles of a step estimated as its enqueue time over the cycle time).

The testbed is removed at the end, also on an error, Ctrl-C or SIGTERM.
"""

import argparse
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.testbed import Testbed, TestbedUnavailable  # noqa: E402

ALLREDUCE = os.path.join(REPO, "benchmarks", "allreduce.py")
#: two ranks on each host; allreduce.py's raw torch.distributed group meets across them because
#: hvdlite-run names the job's interface in GLOO_SOCKET_IFNAME (the testbed's hosts resolve
#: their name to loopback, where torch's Gloo would otherwise bind)
HOSTS = ["-np", "4", "-H", "tbh0:2,tbh1:2"]
#: workloads whose steps are link-bound (the 90 %-of-the-link target applies to them)
BANDWIDTH_WORKLOADS = ("resnet50", "bert", "big64mb")
LINK_TARGET = 0.90
#: the rows the targets apply to: allreduce_async_ of every tensor, and DistributedOptimizer's
#: gradient exchange (its buckets zero-copy inside each host)
TARGET_IMPLS = ("hvdlite_fusion", "hvdlite_optimizer")
RTT_PORT = 5201

_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(i?)(bit|bps)$", re.I)


def rate_bits(rate: str) -> float:
    """A tc rate (``1gbit``, ``100mbit``, ``125mbps``, ``1gibit``) in bits per second."""
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 1gbit, 500mbit)")
    value, prefix, binary, unit = m.groups()
    power = "kmgt".index(prefix.lower()) + 1 if prefix else 0
    scale = (1024 if binary else 1000) ** power
    return float(value) * scale * (8 if unit.lower() == "bps" else 1)


def burst_for(rate: str, burst: str) -> str:
    """The tbf bucket for ``rate``: ``burst`` as given, or (``auto``) 1 ms of the rate and
    at least 256 KiB (tbf needs a bucket of at least rate / timer ticks)."""
    if burst != "auto":
        return burst
    return f"{max(256, -(-int(rate_bits(rate) / 8 / 1000) // 1024))}kb"


def parse_rates(parser, text: str):
    """``--rates``' comma-separated tc rates, each checked (``parser.error`` on a bad one)."""
    rates = [r.strip() for r in text.split(",") if r.strip()]
    for r in rates:
        try:
            rate_bits(r)
        except ValueError as exc:
            parser.error(str(exc))
    if not rates:
        parser.error("--rates is empty")
    return rates


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--rates",
        default="1gbit,10gbit",
        help="comma-separated tc rates for both hosts' links (default 1gbit,10gbit)",
    )
    p.add_argument(
        "--workloads",
        default="resnet50,bert,tiny1000",
        help="allreduce.py workloads (default resnet50,bert,tiny1000)",
    )
    p.add_argument(
        "--impls",
        default="hvdlite_fusion,hvdlite_optimizer",
        help="allreduce.py implementations (default hvdlite_fusion,hvdlite_optimizer; "
        "the raw "
        "baselines torch_flat and memcpy_floor always run; torch_per_tensor "
        "across hosts takes ~5 s a step of tiny1000 here)",
    )
    p.add_argument(
        "--bert-layers",
        type=int,
        default=2,
        help="BERT encoder layers (default 2, not BERT-base's 12: 147 MiB instead "
        "of 418 MiB, so that a 1 Gbit/s step takes ~1.4 s and not ~3.7 s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of all implementations (default 3)",
    )
    p.add_argument("--iters", type=int, help="timed steps per cell (default: allreduce.py's)")
    p.add_argument("--warmup", type=int, help="untimed steps per cell (default: allreduce.py's)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=6.0,
        help="allreduce.py --max-seconds: a cell's time budget over all rounds "
        "(at least one step per round is timed anyway; default 6)",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="time a torch_flat and a memcpy step after each hvdlite step "
        "(allreduce.py's paired columns; off by default: over a 1 Gbit/s link "
        "they more than double each round, and the hvdlite step after a long "
        "flat one measured ~5%% slower)",
    )
    p.add_argument(
        "--no-one-host", action="store_true", help="skip the one-host run (no tiny-op target then)"
    )
    p.add_argument(
        "--one-host-slots",
        type=int,
        default=2,
        help="ranks of the one-host run (default 2: one per core of this machine; "
        "4 puts as many ranks on its 2 cores as the 2-host run does)",
    )
    p.add_argument(
        "--rtt-samples",
        type=int,
        default=1000,
        help="ping-pongs between the hosts per rate (default 1000)",
    )
    p.add_argument(
        "--burst",
        default="auto",
        help="tc tbf burst of the shaped links (default auto: 1 ms of the rate, at "
        "least Testbed.shape's 256kb; a 256kb bucket held one TCP stream to "
        "0.93 of 10gbit)",
    )
    p.add_argument(
        "--job-timeout",
        type=float,
        default=900.0,
        help="seconds one allreduce.py job may take (default 900)",
    )
    p.add_argument("--verbose", action="store_true", help="pass the jobs' output through")
    p.add_argument("--json", metavar="FILE", help="write rows, targets and settings as JSON")
    args = p.parse_args(argv)
    args.rates = parse_rates(p, args.rates)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if "hvdlite_fusion" not in args.impls:
        args.impls.insert(0, "hvdlite_fusion")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


# ----------------------------------------------------------------------------------------
# running things on the testbed


class _Interrupted(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Interrupted(f"signal {signum}")


def run_job(tb, launcher_args, bench_args, out_json, timeout_s, verbose, log, script=ALLREDUCE):
    """``hvdlite-run LAUNCHER_ARGS python SCRIPT BENCH_ARGS --json OUT_JSON`` on tbh0
    (``SCRIPT``: allreduce.py by default); returns the script's JSON and the job's wall time."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p),
    )
    argv = [
        sys.executable,
        "-m",
        "hvdlite.runner.cli.launch",
        *launcher_args,
        *tb.ssh_args(),
        sys.executable,
        script,
        *bench_args,
        "--json",
        out_json,
    ]
    log(
        f"$ hvdlite-run {' '.join(launcher_args)} python benchmarks/{os.path.basename(script)} "
        f"{' '.join(bench_args)}"
    )
    lines = []
    t0 = time.monotonic()
    proc = tb.popen(
        "tbh0",
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if verbose or re.search(r"\bround \d+/\d+ done", line):
                log("  | " + line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:  # timed out or interrupted: end the job
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        reader.join(5)
    took = time.monotonic() - t0
    if rc != 0 or not os.path.exists(out_json):
        tail = "\n".join(lines[-60:])
        why = "timed out" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"the job {why} after {took:.0f} s:\n{tail}")
    with open(out_json) as f:
        return json.load(f), took


_ECHO = (
    "import socket\n"
    "l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "l.bind(('0.0.0.0', {port})); l.listen(1); print('ready', flush=True)\n"
    "c, _ = l.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "while True:\n"
    "    b = c.recv(1)\n"
    "    if not b: break\n"
    "    c.sendall(b)\n"
)
#: the probes' connection to tbh1 (the server may still be starting: retried for 10 s)
_CONNECT = (
    "deadline = time.monotonic() + 10\n"
    "while True:\n"
    "    try:\n"
    "        s = socket.create_connection(('tbh1', {port}), 2); break\n"
    "    except OSError:\n"
    "        if time.monotonic() > deadline: raise\n"
    "        time.sleep(0.05)\n"
)
_PING = (
    "import json, socket, time\n"
    + _CONNECT
    + "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "out = []\n"
    "for i in range({n} + 50):\n"
    "    t = time.perf_counter(); s.sendall(b'x'); s.recv(1)\n"
    "    if i >= 50: out.append(time.perf_counter() - t)\n"
    "s.close(); print(json.dumps(out))\n"
)


def round_trip_ms(tb, samples):
    """Median and 90th percentile (ms) of 1-byte TCP ping-pongs from tbh0 to tbh1."""
    server = tb.popen(
        "tbh1",
        [sys.executable, "-c", _ECHO.format(port=RTT_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server.stdout.readline()
        done = tb.run(
            "tbh0",
            [sys.executable, "-c", _PING.format(port=RTT_PORT, n=samples)],
            capture_output=True,
            text=True,
            timeout_s=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"round-trip probe failed: {done.stderr.strip()}")
        times = sorted(1e3 * t for t in json.loads(done.stdout))
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
    return {
        "median_ms": statistics.median(times),
        "p90_ms": times[int(0.9 * len(times))],
        "min_ms": times[0],
        "samples": len(times),
    }


_SINK = (
    "import socket, sys, threading\n"
    "n = int(sys.argv[1])\n"
    "l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "l.bind(('0.0.0.0', {port})); l.listen(1); print('ready', flush=True)\n"
    "c, _ = l.accept()\n"
    "def send():\n"
    "    buf, left = b'x' * (1 << 20), n\n"
    "    while left > 0:\n"
    "        left -= c.send(buf[:min(left, len(buf))])\n"
    "t = threading.Thread(target=send); t.start()\n"
    "got, buf = 0, bytearray(1 << 20)\n"
    "while got < n:\n"
    "    k = c.recv_into(buf)\n"
    "    if not k: break\n"
    "    got += k\n"
    "t.join(); c.sendall(b'k'); c.close()\n"
)
_SOURCE = (
    "import socket, sys, threading, time\n"
    "n = int(sys.argv[1])\n" + _CONNECT + "def recv():\n"
    "    got, buf = 0, bytearray(1 << 20)\n"
    "    while got < n:\n"
    "        k = s.recv_into(buf)\n"
    "        if not k: break\n"
    "        got += k\n"
    "t0 = time.perf_counter()\n"
    "r = threading.Thread(target=recv); r.start()\n"
    "buf, left = b'x' * (1 << 20), n\n"
    "while left > 0:\n"
    "    left -= s.send(buf[:min(left, len(buf))])\n"
    "r.join(); s.recv(1); print(time.perf_counter() - t0)\n"
)


def tcp_both_ways(tb, rate):
    """What one TCP connection carries each way at once over the shaped link: N bytes from
    tbh0 to tbh1 while N go back (N = 0.5 s of the rate, at least 32 MB); the payload rate
    and its share of ``rate`` (the ceiling of any allreduce over TCP here: the headers and
    the other direction's ACKs take tokens of the bucket too)."""
    n = max(32_000_000, int(rate_bits(rate) / 8 * 0.5))
    server = tb.popen(
        "tbh1",
        [sys.executable, "-c", _SINK.format(port=RTT_PORT + 1), str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        server.stdout.readline()
        done = tb.run(
            "tbh0",
            [sys.executable, "-c", _SOURCE.format(port=RTT_PORT + 1), str(n)],
            capture_output=True,
            text=True,
            timeout_s=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"TCP throughput probe failed: {done.stderr.strip()}")
        took = float(done.stdout)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
    gbit = n * 8 / took / 1e9
    return {
        "bytes_each_way": n,
        "seconds": took,
        "gbit_per_s": gbit,
        "ratio": gbit * 1e9 / rate_bits(rate),
    }


def qdisc_stats(tb, host):
    """``tc -s qdisc`` of a host's link, both ends (drops and overlimits tell how tbf held)."""
    h = tb.host(host)
    out = {}
    for ns, dev in ((h.namespace, "eth0"), (tb.switch, h.port_name)):
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
            capture_output=True,
            text=True,
        )
        out[f"{ns}:{dev}"] = proc.stdout.strip()
    return out


# ----------------------------------------------------------------------------------------
# rows and targets


def make_rows(result, setup, rate, rtt):
    """allreduce.py's rows with the link columns added."""
    rows = []
    bps = rate_bits(rate) if rate else None
    cycle_ms = result["meta"].get("cycle_time_ms")
    for r in result["rows"]:
        sec = r["ms_median"] / 1e3
        # hierarchical allreduce between 2 hosts: B bytes each way over each host's link
        # (memcpy_floor, each rank copying its own bytes, sends nothing)
        link_bytes = r["bytes"] if setup == "2 hosts" and r["impl"] != "memcpy_floor" else 0
        row = {
            "setup": setup,
            "rate": rate,
            "workload": r["workload"],
            "impl": r["impl"],
            "bytes": r["bytes"],
            "tensors": r["tensors"],
            "iters": r["iters"],
            "ms_median": r["ms_median"],
            "ms_min": r["ms_min"],
            "ms_max": r["ms_max"],
            "round_medians_ms": r["round_medians_ms"],
            "ratio_to_flat": r["ratio_to_flat"],
            "paired_ratio_to_flat": r.get("paired_ratio_to_flat"),
            "link_bytes_each_way": link_bytes,
        }
        if link_bytes:
            row["link_gbit_per_s"] = link_bytes * 8 / sec / 1e9
            row["link_ratio"] = link_bytes * 8 / sec / bps if bps else None
        if rtt:
            row["rtt_ms"] = rtt["median_ms"]
        if r.get("ms_enqueue_median") is not None and cycle_ms:
            # the background loop gathers submissions for one cycle time before negotiating,
            # so a step whose allreduce_async_ calls take E ms spans about E / cycle cycles
            row["ms_enqueue_median"] = r["ms_enqueue_median"]
            row["cycles_per_step_est"] = max(1, math.ceil(r["ms_enqueue_median"] / cycle_ms))
        rows.append(row)
    return rows


def targets(rows):
    by = {(r["setup"], r["rate"], r["workload"], r["impl"]): r for r in rows}
    one_host = {
        r["workload"]: r for r in rows if r["setup"] == "1 host" and r["impl"] == "hvdlite_fusion"
    }
    out = {}
    for r in rows:
        if r["setup"] != "2 hosts" or r["impl"] not in TARGET_IMPLS:
            continue
        if r["impl"] == "hvdlite_optimizer" and r["workload"] not in BANDWIDTH_WORKLOADS:
            continue
        key, w = f"{r['rate']}_{r['workload']}", r["workload"]
        if r["impl"] != "hvdlite_fusion":
            key += "_" + r["impl"][len("hvdlite_") :]
        if w in BANDWIDTH_WORKLOADS and r.get("link_ratio") is not None:
            v = r["link_ratio"]
            out[f"{key}_link_ratio"] = {
                "value": v,
                "target": f">= {LINK_TARGET:.2f}",
                "met": v >= LINK_TARGET,
            }
        flat = by.get(("2 hosts", r["rate"], w, "torch_flat"))
        # not for tiny1000: torch_flat reduces its 1000 tensors pre-flattened into one
        if flat and w in BANDWIDTH_WORKLOADS:
            v = r["ms_median"] / flat["ms_median"]
            out[f"{key}_vs_torch_flat"] = {"value": v, "target": "< 1", "met": v < 1}
        if w == "tiny1000" and w in one_host and r.get("rtt_ms") is not None:
            cycles = r.get("cycles_per_step_est", 1)
            limit = 2 * one_host[w]["ms_median"] + cycles * r["rtt_ms"]
            v = r["ms_median"] / limit
            out[f"{key}_vs_one_host"] = {
                "value": v,
                "target": "<= 1 (ms / (2 x one-host ms + a round trip per cycle))",
                "met": v <= 1,
                "ms": r["ms_median"],
                "one_host_ms": one_host[w]["ms_median"],
                "rtt_ms": r["rtt_ms"],
                "cycles_per_step_est": cycles,
                "limit_ms": limit,
            }
    return out


MiB = 1024 * 1024


def print_table(rows, tgts, runs, rtts, load, tcps=None, out=sys.stdout):
    paired = any(r.get("paired_ratio_to_flat") for r in rows)
    head = (
        f"{'setup':<8s} {'rate':<7s} {'workload':<9s} {'impl':<17s} {'MiB':>6s} "
        f"{'n':>3s} {'ms/step':>9s} {'rounds (ms)':<22s} {'link Gb/s':>9s} "
        f"{'x link':>6s} {'x flat':>6s}" + (f" {'paired':>6s}" if paired else "")
    )
    print(file=out)
    print(head, file=out)
    print("-" * len(head), file=out)
    last = None
    for r in rows:
        group = (r["setup"], r["rate"])
        if last is not None and group != last:
            print(file=out)
        last = group
        lg, lr, pr = r.get("link_gbit_per_s"), r.get("link_ratio"), r.get("paired_ratio_to_flat")
        rounds = "/".join(f"{m:.0f}" if m >= 100 else f"{m:.1f}" for m in r["round_medians_ms"])
        print(
            f"{r['setup']:<8s} {(r['rate'] or '-'):<7s} {r['workload']:<9s} "
            f"{r['impl']:<17s} {r['bytes'] / MiB:>6.1f} {r['iters']:>3d} "
            f"{r['ms_median']:>9.2f} {rounds:<22.22s} "
            f"{(f'{lg:.3f}' if lg else '-'):>9s} {(f'{lr:.2f}' if lr else '-'):>6s} "
            f"{r['ratio_to_flat']:>6.2f}"
            + (f" {(f'{pr:.2f}' if pr else '-'):>6s}" if paired else ""),
            file=out,
        )
    print(file=out)
    print(
        "ms/step = median of the steps of all rounds (rank 0); rounds = each round's median; "
        "link Gb/s = B bytes\n(what a 2-host hierarchical allreduce of B bytes carries each way "
        "over a host's link) * 8 / ms/step;\nx link = that / the shaped rate; x flat = ms/step "
        "/ torch_flat's"
        + ("; paired = median of hvdlite step / the torch_flat step after it" if paired else ""),
        file=out,
    )
    for rate, rtt in rtts.items():
        print(
            f"round trip tbh0 <-> tbh1 at {rate}: median {rtt['median_ms']:.3f} ms, "
            f"p90 {rtt['p90_ms']:.3f} ms ({rtt['samples']} 1-byte TCP ping-pongs)",
            file=out,
        )
    for rate, tcp in (tcps or {}).items():
        print(
            f"one TCP connection at {rate}, {tcp['bytes_each_way'] / 1e6:.0f} MB each way at "
            f"once: {tcp['gbit_per_s']:.3f} Gbit/s each way = {tcp['ratio']:.2f} of the rate "
            f"(the most x link can be)",
            file=out,
        )
    for run in runs:
        print(
            f"job {run['setup']} {run['rate'] or ''}: {run['wall_s']:.0f} s, load "
            f"{run['load_start'][0]:.2f} -> {run['load_end'][0]:.2f} (1-min avg)",
            file=out,
        )
    print(f"machine load (1/5/15-min): start {load['start']}, end {load['end']}", file=out)
    for k, v in tgts.items():
        print(
            f"target {k}: {v['value']:.2f} (want {v['target']}) -> "
            f"{'MET' if v['met'] else 'MISSED'}",
            file=out,
        )
    out.flush()


# ----------------------------------------------------------------------------------------


def _load():
    return [round(x, 2) for x in os.getloadavg()]


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    bench = [
        "--workloads",
        ",".join(args.workloads),
        "--impls",
        ",".join(args.impls),
        "--rounds",
        str(args.rounds),
        "--bert-layers",
        str(args.bert_layers),
        "--max-seconds",
        str(args.max_seconds),
    ]
    if args.iters is not None:
        bench += ["--iters", str(args.iters)]
    if args.warmup is not None:
        bench += ["--warmup", str(args.warmup)]
    if not args.paired:
        bench.append("--no-paired")
    load = {"start": _load()}
    t_start = time.monotonic()
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    rows, runs, rtts, tcps, qdiscs = [], [], {}, {}, {}
    tmp = tempfile.mkdtemp(prefix="hvdlite-crosshost-")
    tb = None
    described = None
    try:
        try:
            tb = Testbed(2)
        except TestbedUnavailable as exc:
            print(f"crosshost: {exc}", file=sys.stderr)
            return 2
        described = tb.describe()
        log(f"testbed: {', '.join(f'{h.name} {h.address}' for h in tb.hosts)}")
        if not args.no_one_host:
            n = args.one_host_slots
            log(f"one host, unshaped (np={n}, -H tbh0:{n})")
            ld0 = _load()
            res, took = run_job(
                tb,
                ["-np", str(n), "-H", f"tbh0:{n}"],
                bench,
                os.path.join(tmp, "one_host.json"),
                args.job_timeout,
                args.verbose,
                log,
            )
            runs.append(
                {
                    "setup": "1 host",
                    "rate": None,
                    "wall_s": took,
                    "load_start": ld0,
                    "load_end": _load(),
                    "meta": res["meta"],
                }
            )
            rows += make_rows(res, "1 host", None, None)
        for rate in args.rates:
            for h in tb.hosts:
                tb.shape(h.name, rate, burst=burst_for(rate, args.burst))
            rtt = round_trip_ms(tb, args.rtt_samples)
            rtts[rate] = rtt
            tcps[rate] = tcp_both_ways(tb, rate)
            log(
                f"2 hosts at {rate} (np=4, -H tbh0:2,tbh1:2); round trip "
                f"{rtt['median_ms']:.3f} ms; one TCP connection both ways "
                f"{tcps[rate]['ratio']:.2f} of the rate"
            )
            ld0 = _load()
            res, took = run_job(
                tb,
                HOSTS,
                bench,
                os.path.join(tmp, f"hosts_{rate}.json"),
                args.job_timeout,
                args.verbose,
                log,
            )
            runs.append(
                {
                    "setup": "2 hosts",
                    "rate": rate,
                    "wall_s": took,
                    "load_start": ld0,
                    "burst": burst_for(rate, args.burst),
                    "load_end": _load(),
                    "meta": res["meta"],
                }
            )
            rows += make_rows(res, "2 hosts", rate, rtt)
            qdiscs[rate] = qdisc_stats(tb, "tbh1")
            for h in tb.hosts:
                tb.unshape(h.name)
    except (KeyboardInterrupt, _Interrupted) as exc:
        print(
            f"crosshost: interrupted ({str(exc) or 'Ctrl-C'}); removing the testbed",
            file=sys.stderr,
        )
        return 130
    finally:
        if tb is not None:
            tb.close()
        signal.signal(signal.SIGTERM, old_term)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    load["end"] = _load()
    tgts = targets(rows)
    print_table(rows, tgts, runs, rtts, load, tcps)
    if args.json:
        meta = {
            "argv": sys.argv[1:],
            "rates": args.rates,
            "workloads": args.workloads,
            "impls": args.impls,
            "bert_layers": args.bert_layers,
            "rounds": args.rounds,
            "iters": args.iters,
            "warmup": args.warmup,
            "max_seconds": args.max_seconds,
            "burst": args.burst,
            "testbed": described,
            "python": platform.python_version(),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "load": load,
            "elapsed_s": time.monotonic() - t_start,
            "link_bytes": "B each way per host link (2(H-1)/H * B, H = 2 hosts)",
        }
        with open(args.json, "w") as f:
            json.dump(
                {
                    "meta": meta,
                    "runs": runs,
                    "round_trips": rtts,
                    "tcp_both_ways": tcps,
                    "rows": rows,
                    "targets": tgts,
                    "qdisc_stats": qdiscs,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
