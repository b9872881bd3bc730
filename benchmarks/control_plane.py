#!/usr/bin/env python
"""Control-plane scaling: how the per-cycle cost of agreement grows with the number of ranks.

Run from the repository root (it starts the jobs itself; do not wrap it in hvdlite-run)::

    .venv/bin/python benchmarks/control_plane.py [--process-np 2,4,8,16]
        [--thread-np 2,4,8,16,32,64] [--mirror-np 2,4,...,1024] [--controller-np 2,4,...,1024]
        [--tensors 16] [--hit-steps 30] [--miss-steps 15] [--run-timeout 240]
        [--process-hosts 2x2,4x2 --ssh-port PORT --ssh-identity KEY
         --cross-min ring,dissemination --repeats 3]
        [--json FILE] [--plot FILE.png] [--quick]

Four sources of numbers, kept apart in the table and the JSON:

* ``process`` rows: real processes through ``hvdlite-run -np N --no-shared-memory`` (Gloo over TCP
  loopback, so every control collective takes the cross-host code path).  Each rank builds the
  real :class:`~hvdlite.common.engine.runtime.Runtime` on the real :class:`GlooBackend`; the benchmark
  only wraps the backend in :class:`TimedBackend` (a delegating proxy that times the two control
  collectives) and replaces the runtime's controller, before the thread starts, by
  :class:`TimedController` (a :class:`Controller` subclass that times ``ingest``).  No runtime
  code is changed.
* ``thread`` rows: the same Runtime objects as threads of this process over
  ``tests/common/loopback.py`` (one GIL, a barrier per collective): sizes real processes cannot
  reach on a 2-core machine.  Wall times there are dominated by GIL hand-offs; the per-thread CPU
  time (``time.thread_time``) of rank 0's background thread is the comparable number.
* ``mirror`` rows: one Runtime, rank 0 of an ``np``-rank job whose peers all send exactly what
  it sends (:class:`MirrorBackend`; the MIN of identical vectors is the vector, the allgather is
  ``np`` copies of the payload): every rank's CPU work per cycle at that size -- full-size
  control vector, ``np`` payloads decoded, the controller over ``np x tensors`` requests --
  measured directly up to 1,024 ranks, with no transport at all.
* ``hosts`` rows (``--process-hosts HxS,...``): the process harness on H loopback hosts
  (127.0.0.1 .. 127.0.0.H, all reached through one sshd: ``--ssh-port``, ``--ssh-identity``
  are passed to ``hvdlite-run``) of S slots each, with shared memory on: the control vector is
  reduced through each host's segment, then across the hosts.  ``--cross-min`` names how that
  cross-host MIN runs, by dissemination (the default) or by Gloo's ring allreduce (a
  benchmark knob: the worker sets :attr:`GlooBackend.cross_min_by_dissemination`); with both
  (``ring,dissemination``) each layout runs with each in turn, ``--repeats`` times, and the
  ratios of the medians (dissemination / ring) are printed.  The row's ``hierarchical`` says
  the job really ran over shared memory and a cross-host group.
* ``controller`` rows: one process, no transport: the CPU work every hvdlite rank (and Horovod's
  coordinator) does on a cache miss -- decoding every rank's request payload and running the
  deterministic :class:`Controller` over ``np x tensors`` requests -- measured directly up to
  1,024 ranks.

Per job, every rank runs the same steps: each step submits ``--tensors`` allreduces of 4 floats
(one enqueue) and waits for them.  Two warm-up steps, then ``--hit-steps`` steps that reuse the
same names (the response cache answers: one control allreduce per cycle, no allgather), then
``--miss-steps`` steps with fresh names (every step negotiates: control allreduce + allgather of
the requests + decode + controller).  Rank 0's background thread reports, per cycle: the control
allreduce's wall time, the allgather's wall time and bytes, decode+ingest time, and the thread's
CPU time.  Medians are reported.

Exact (not measured) columns come from the control-vector layout in ``hvdlite/common/engine/runtime.py``:
``4 * (4 + Parameters.WIDTH + np + cache_capacity)`` bytes per rank per cycle.

``--json FILE`` writes every row, the fits and the predictions; ``--plot FILE.png`` draws them
(needs matplotlib, in requirements.txt).  Every job is bounded by ``--run-timeout`` seconds (a
job that times out is reported as such and the run goes on).  ``--quick`` is the smoke-test
size (thread harness at np=2, mirror at np=2 and 8, a few steps, no processes).  Worker mode
(``--worker``) is internal: it is what ``hvdlite-run`` starts on each rank.
"""

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # for tests.common.loopback (the thread harness)
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from hvdlite.common.engine import control_vector as cv  # noqa: E402
from hvdlite.common.backend.base import Backend  # noqa: E402
from hvdlite.common.config import Config  # noqa: E402
from hvdlite.common.engine.controller import Controller  # noqa: E402
from hvdlite.common.engine.message import (  # noqa: E402
    OpType,
    ReduceOp,
    Request,
    decode_requests,
    encode_requests,
)
from hvdlite.common.engine.parameters import Parameters  # noqa: E402
from hvdlite.common.engine.runtime import Runtime  # noqa: E402
from hvdlite.common.engine.tensor_queue import Entry, Handle  # noqa: E402

#: the int32 fields in front of the per-rank alive flags (need, -len, stall, version, params)
HEADER_INTS = 6 + Parameters.WIDTH
#: Horovod's cache bit vector: 3 status bits + one bit per active cache entry, in 64-bit words
HOROVOD_STATUS_BITS = 3
PREDICT_AT = (256, 1024)
#: fits use sizes up to this (what the process and thread jobs reach)
FIT_MAX_NP = 64


# --------------------------------------------------------------------------------------------
# exact sizes (from the vector layout; nothing measured)


def control_vector_bytes(size: int, cache_capacity: int) -> int:
    """Bytes of hvdlite's per-cycle control vector (every rank contributes one); the same at
    every size since the vector became O(1) (hvdlite/common/engine/control_vector.py)."""
    return 4 * cv.length(cache_capacity)


def control_vector_bytes_before(size: int, cache_capacity: int) -> int:
    """The vector before it was packed: an int per rank (twice) and per cache slot."""
    return 4 * (HEADER_INTS + 2 * size + cache_capacity)


def horovod_bitvector_bytes(active_entries: int) -> int:
    """Bytes of Horovod's per-cycle cache bit vector (AND-allreduced by every rank)."""
    return 8 * math.ceil((active_entries + HOROVOD_STATUS_BITS) / 64)


# --------------------------------------------------------------------------------------------
# instrumentation: a backend proxy and a controller subclass (no runtime code changed)


class CycleLog:
    """Rank 0's per-cycle measurements, written by its background thread only."""

    def __init__(self):
        self.recording = False
        self.phase = "warmup"
        self.cycles: List[dict] = []
        self._open: Optional[dict] = None

    def begin(self, wall: float, cpu: float) -> None:
        """A control allreduce starts: the previous cycle ends here."""
        if self._open is not None:
            self._open["cpu_s"] = cpu - self._open["cpu0"]
            self._open["span_s"] = wall - self._open["wall0"]
            self.cycles.append(self._open)
            self._open = None
        if self.recording:
            self._open = {
                "phase": self.phase,
                "wall0": wall,
                "cpu0": cpu,
                "ar_s": 0.0,
                "ag_s": None,
                "ag_bytes": 0,
                "ingest_s": None,
                "decode_s": None,
                "data": 0,
            }


class TimedBackend:
    """Delegates everything to the real backend; times the two control collectives."""

    def __init__(self, inner, log: Optional[CycleLog]):
        self._inner = inner
        self._log = log
        self._ag_end = 0.0
        self.vec_len = -1  # the control vector's length; shorter: a second round

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def control_allreduce_min(self, vec):
        log = self._log
        if log is None:
            return self._inner.control_allreduce_min(vec)
        t0 = time.perf_counter()
        second = len(vec) != self.vec_len  # the cache bits' second round: same cycle
        if not second:
            log.begin(t0, time.thread_time())
        out = self._inner.control_allreduce_min(vec)
        if log._open is not None:
            log._open["ar_s"] += time.perf_counter() - t0
        return out

    def control_allgather(self, payload, max_len):
        log = self._log
        t0 = time.perf_counter()
        out = self._inner.control_allgather(payload, max_len)
        self._ag_end = t1 = time.perf_counter()
        if log is not None and log._open is not None:
            log._open["ag_s"] = t1 - t0
            log._open["ag_bytes"] = self.size * (max_len + 4)  # what every rank receives
        return out

    def _count_data(self) -> None:
        if self._log is not None and self._log._open is not None:
            self._log._open["data"] += 1

    def allreduce_(self, tensor, op):
        self._count_data()
        return self._inner.allreduce_(tensor, op)

    def allreduce_async_(self, tensor, op):
        self._count_data()
        return self._inner.allreduce_async_(tensor, op)

    # the executor's entries with shared memory on (hosts rows)
    def allreduce_scaled_(self, tensor, op, prescale, postscale):
        self._count_data()
        return self._inner.allreduce_scaled_(tensor, op, prescale, postscale)

    def allreduce_scaled_many_async_(self, tensors, op, prescale, postscale):
        self._count_data()
        return self._inner.allreduce_scaled_many_async_(tensors, op, prescale, postscale)

    def allreduce_staged_(self, staged, op, scale):
        self._count_data()
        return self._inner.allreduce_staged_(staged, op, scale)


class TimedController(Controller):
    """The real controller; ``ingest`` is timed (decode time = gap after the allgather)."""

    def __init__(self, size: int, backend: TimedBackend, log: Optional[CycleLog]):
        super().__init__(size)
        self._backend = backend
        self._log = log

    def ingest(self, gathered, cycle):
        t0 = time.perf_counter()
        out = super().ingest(gathered, cycle)
        log = self._log
        if log is not None and log._open is not None and log._open["ingest_s"] is None:
            log._open["ingest_s"] = time.perf_counter() - t0
            log._open["decode_s"] = t0 - self._backend._ag_end
        return out

    def ingest_uniform(self, requests, cycle):
        t0 = time.perf_counter()
        out = super().ingest_uniform(requests, cycle)
        log = self._log
        if log is not None and log._open is not None:
            log._open["ingest_s"] = time.perf_counter() - t0
            log._open["decode_s"] = 0.0  # nothing gathered, nothing decoded
        return out


def instrument(runtime: Runtime, log: Optional[CycleLog]) -> None:
    """Wrap a runtime's backend and controller (call before ``runtime.start()``)."""
    timed = TimedBackend(runtime.backend, log)
    timed.vec_len = runtime._vec_len
    runtime.backend = timed
    runtime.executor.backend = timed
    runtime.controller = TimedController(runtime.size, timed, log)


# --------------------------------------------------------------------------------------------
# what every rank does (both harnesses)


def lockstep(backend, vec_len: int, payload_len: int, reps: int) -> Dict[str, float]:
    """The two control collectives back to back on an idle backend (before the runtime
    starts), so the transport's own latency is seen without the ranks' skew; medians, ms."""
    vec = np.ones(vec_len, dtype=np.int32)
    payload = b"x" * payload_len
    ar, ag = [], []
    for i in range(reps + 2):  # two warm-up rounds
        t0 = time.perf_counter()
        backend.control_allreduce_min(vec.copy())
        t1 = time.perf_counter()
        backend.control_allgather(payload, payload_len)
        t2 = time.perf_counter()
        if i >= 2:
            ar.append(t1 - t0)
            ag.append(t2 - t1)
    return {
        "lockstep_control_allreduce_ms": statistics.median(ar) * 1e3,
        "lockstep_control_allreduce_p90_ms": p90(ar),
        "lockstep_allgather_ms": statistics.median(ag) * 1e3,
    }


def p90(xs) -> Optional[float]:
    """The 90th percentile of seconds ``xs``, in ms (None when there are none)."""
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] * 1e3 if xs else None


def _step(rt: Runtime, names: List[str], bufs, timeout_s: float) -> float:
    handle = Handle(len(names))
    entries = [
        Entry(
            Request(n, OpType.ALLREDUCE, "float32", (4,), reduce_op=int(ReduceOp.SUM)),
            bufs[i],
            bufs[i],
            handle,
            i,
        )
        for i, n in enumerate(names)
    ]
    t0 = time.perf_counter()
    rt.enqueue(entries)
    if not handle.wait(timeout_s):
        raise TimeoutError(
            f"rank {rt.rank}: a step of {len(names)} allreduces did not "
            f"complete within {timeout_s:g}s"
        )
    handle.value()  # raises the step's error, if any
    return time.perf_counter() - t0


def run_rank(
    rt: Runtime,
    log: Optional[CycleLog],
    tensors: int,
    hit_steps: int,
    miss_steps: int,
    timeout_s: float,
) -> Dict[str, List[float]]:
    """The benchmark body on one rank; returns this rank's step times by phase."""
    import torch

    bufs = [torch.ones(4) for _ in range(tensors)]
    hit_names = [f"grad.layer{i}.weight" for i in range(tensors)]
    for _ in range(2):  # negotiate once, then one cache hit
        _step(rt, hit_names, bufs, timeout_s)
    times = {"hit": [], "miss": []}
    if log is not None:
        log.phase, log.recording = "hit", True
    for _ in range(hit_steps):
        times["hit"].append(_step(rt, hit_names, bufs, timeout_s))
    if log is not None:
        log.phase = "miss"
    for s in range(miss_steps):
        names = [f"step{s}.grad.layer{i}.weight" for i in range(tensors)]
        times["miss"].append(_step(rt, names, bufs, timeout_s))
    if log is not None:
        log.recording = False
    return times


def summarize(
    log: CycleLog, times: Dict[str, List[float]], size: int, cache_capacity: int, harness: str
) -> dict:
    """One table row from rank 0's cycle log and step times (medians, ms)."""

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) * 1e3 if xs else None

    cycles = log.cycles
    # a negotiating cycle ran the controller (with an allgather, or uniform without one)
    miss = [c for c in cycles if c["ingest_s"] is not None]
    hit = [c for c in cycles if c["phase"] == "hit" and c["ingest_s"] is None and c["data"] > 0]
    hit_phase = [c for c in cycles if c["phase"] == "hit"]
    miss_phase = [c for c in cycles if c["phase"] == "miss"]
    return {
        "harness": harness,
        "np": size,
        "vector_bytes": control_vector_bytes(size, cache_capacity),
        "miss_cycles": len(miss),
        "hit_cycles": len(hit),
        "hit_steps": len(times["hit"]),
        "miss_steps": len(times["miss"]),
        "cycles_per_hit_step": len(hit_phase) / max(1, len(times["hit"])),
        "cycles_per_miss_step": len(miss_phase) / max(1, len(times["miss"])),
        # negotiation on a cache miss: control allreduce + allgather + decode + controller
        "miss_negotiation_ms": med(
            [
                c["ar_s"] + (c["ag_s"] or 0) + (c["decode_s"] or 0) + (c["ingest_s"] or 0)
                for c in miss
            ]
        ),
        "uniform_negotiations": sum(1 for c in miss if c["ag_s"] is None),
        "miss_control_allreduce_ms": med([c["ar_s"] for c in miss]),
        "miss_allgather_ms": med([c["ag_s"] for c in miss]),
        "miss_decode_ingest_ms": med([(c["decode_s"] or 0) + (c["ingest_s"] or 0) for c in miss]),
        "miss_allgather_bytes": int(statistics.median([c["ag_bytes"] for c in miss]))
        if miss
        else None,
        "vector_bytes_before": control_vector_bytes_before(size, cache_capacity),
        "rank0_miss_cycle_cpu_ms": med([c.get("cpu_s") for c in miss]),
        # steady state: the cache answers, one control allreduce per cycle
        "hit_control_allreduce_ms": med([c["ar_s"] for c in hit]),
        # its tail: one slow exchange in ten (scheduling on a loaded machine shows here)
        "hit_control_allreduce_p90_ms": p90([c["ar_s"] for c in hit]),
        "rank0_hit_cycle_cpu_ms": med([c.get("cpu_s") for c in hit]),
        "hit_step_ms": med(times["hit"]),
        "miss_step_ms": med(times["miss"]),
    }


# --------------------------------------------------------------------------------------------
# harness 1: real processes (worker mode runs on every rank under hvdlite-run)


def worker_main(args) -> int:
    from hvdlite.common.backend.gloo import GlooBackend

    config = Config.from_env()
    backend = GlooBackend.for_job(config, -1)
    config = config.replace(
        rank=backend.rank,
        size=backend.size,
        local_rank=backend.local_rank,
        local_size=backend.local_size,
        cross_rank=backend.cross_rank,
        cross_size=backend.cross_size,
    )
    if args.cross_min == "ring":
        backend.cross_min_by_dissemination = False
    hierarchical = backend._shm is not None and backend._cross_pg is not None
    rt = Runtime(config, backend)
    ls = lockstep(
        backend,
        control_vector_bytes(backend.size, config.cache_capacity) // 4,
        args.payload_len,
        args.lockstep_reps,
    )
    log = CycleLog() if backend.rank == 0 else None
    instrument(rt, log)
    rt.start()
    t0 = time.perf_counter()
    try:
        times = run_rank(rt, log, args.tensors, args.hit_steps, args.miss_steps, args.step_timeout)
    finally:
        stopped = rt.stop(30)
    if backend.rank == 0:
        row = summarize(log, times, backend.size, config.cache_capacity, "process")
        row.update(ls)
        row["wall_s"] = time.perf_counter() - t0
        row["stopped_cleanly"] = stopped
        row["hierarchical"] = hierarchical
        with open(args.out, "w") as f:
            json.dump(row, f)
    return 0


def run_process_job(
    size: int, args, hosts: Optional[str] = None, cross_min: str = "dissemination"
) -> dict:
    """``hvdlite-run -np size --no-shared-memory`` this script in worker mode; rank 0's row.
    With ``hosts`` ("HxS"): ``-np H*S -H 127.0.0.1:S,...`` with shared memory on, the
    cross-host MIN run as ``cross_min`` says."""
    harness = "process" if hosts is None else "hosts"
    with tempfile.TemporaryDirectory(prefix="hvdlite-cp-") as tmp:
        out = os.path.join(tmp, "row.json")
        if hosts is None:
            where = ["--no-shared-memory"]
        else:
            where = ["-H", loopback_hosts(hosts)]
            if args.ssh_port:
                where += ["--ssh-port", str(args.ssh_port)]
            if args.ssh_identity:
                where += ["--ssh-identity-file", args.ssh_identity]
        cmd = [
            sys.executable,
            "-m",
            "hvdlite.runner.cli.launch",
            "-np",
            str(size),
            *where,
            "--start-timeout",
            str(int(args.run_timeout)),
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--out",
            out,
            "--tensors",
            str(args.tensors),
            "--hit-steps",
            str(args.hit_steps),
            "--miss-steps",
            str(args.miss_steps),
            "--step-timeout",
            str(args.step_timeout),
            "--payload-len",
            str(args.payload_len),
            "--lockstep-reps",
            str(args.lockstep_reps),
            "--cross-min",
            cross_min,
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        label = {"harness": harness, "np": size}
        if hosts is not None:
            label.update(layout=hosts, cross_min=cross_min)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.run_timeout
            )
        except subprocess.TimeoutExpired:
            return dict(label, error=f"timed out after {args.run_timeout:g}s (--run-timeout)")
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-1500:]
            return dict(label, error=f"exit code {proc.returncode}: {tail}")
        with open(out) as f:
            row = json.load(f)
        row.update(label)
        row["job_s"] = time.perf_counter() - t0
        return row


def parse_layout(text: str) -> Tuple[int, int]:
    """ "HxS" -> (hosts, slots per host)."""
    hosts, _, slots = text.partition("x")
    if not (hosts.isdigit() and slots.isdigit() and int(hosts) >= 1 and int(slots) >= 1):
        raise SystemExit(f"--process-hosts: {text!r} is not HOSTSxSLOTS (e.g. 2x2)")
    return int(hosts), int(slots)


def loopback_hosts(layout: str) -> str:
    """The ``-H`` list of a layout: 127.0.0.1 (this machine, no SSH) and 127.0.0.2, ... (through
    the sshd, which must listen on each)."""
    hosts, slots = parse_layout(layout)
    return ",".join(f"127.0.0.{h + 1}:{slots}" for h in range(hosts))


def run_host_jobs(args) -> List[dict]:
    """Every ``--process-hosts`` layout with every ``--cross-min`` in turn, ``--repeats``
    times (alternating, so a change of load falls on both alike)."""
    rows = []
    kinds = [k for k in args.cross_min.split(",") if k]
    unknown = set(kinds) - {"ring", "dissemination"}
    if unknown:
        raise SystemExit(f"--cross-min: {sorted(unknown)} unknown (ring, dissemination)")
    for rep in range(args.repeats):
        for layout in [x for x in args.process_hosts.split(",") if x]:
            hosts, slots = parse_layout(layout)
            for kind in kinds:
                print(
                    f"# hosts {layout} cross-min {kind} (repeat {rep + 1} of {args.repeats}) ...",
                    file=sys.stderr,
                    flush=True,
                )
                row = run_process_job(hosts * slots, args, layout, kind)
                row["repeat"] = rep
                rows.append(row)
    return rows


#: what the cross-min ratios compare (rank 0's medians per job)
CROSS_MIN_METRICS = (
    "hit_control_allreduce_ms",
    "hit_control_allreduce_p90_ms",
    "lockstep_control_allreduce_ms",
    "lockstep_control_allreduce_p90_ms",
    "hit_step_ms",
)


def cross_min_ratios(rows: List[dict]) -> List[dict]:
    """Per layout: the median over repeats of each metric, by cross-min kind, and
    dissemination / ring."""
    out = []
    good = [r for r in rows if r["harness"] == "hosts" and "error" not in r]
    for layout in sorted({r["layout"] for r in good}, key=parse_layout):
        entry = {"layout": layout, "np": None, "repeats": {}}
        for kind in ("ring", "dissemination"):
            mine = [r for r in good if r["layout"] == layout and r["cross_min"] == kind]
            entry["repeats"][kind] = len(mine)
            for m in CROSS_MIN_METRICS:
                vals = [r[m] for r in mine if r.get(m) is not None]
                entry[f"{kind}:{m}"] = statistics.median(vals) if vals else None
            if mine:
                entry["np"] = mine[0]["np"]
        for m in CROSS_MIN_METRICS:
            ring, dis = entry.get(f"ring:{m}"), entry.get(f"dissemination:{m}")
            entry[f"ratio:{m}"] = dis / ring if ring and dis is not None else None
        out.append(entry)
    return out


# --------------------------------------------------------------------------------------------
# harness 2: runtimes as threads of this process over the loopback backend


def run_thread_job(size: int, args) -> dict:
    from tests.common.loopback import Hub, LoopbackBackend

    hub = Hub(size, timeout_s=args.step_timeout)
    log = CycleLog()
    rts = []
    for r in range(size):
        rt = Runtime(Config(rank=r, size=size), LoopbackBackend(hub, r))
        instrument(rt, log if r == 0 else None)
        rts.append(rt)
    results: Dict[int, dict] = {}
    errors = []
    lock: Dict[str, float] = {}

    def pre(r):
        try:
            out = lockstep(
                rts[r].backend,
                control_vector_bytes(size, rts[r].config.cache_capacity) // 4,
                args.payload_len,
                args.lockstep_reps,
            )
            if r == 0:
                lock.update(out)
        except BaseException as exc:  # reported in the row, with the rank
            errors.append(f"rank {r} (lockstep): {type(exc).__name__}: {exc}")

    pre_threads = [threading.Thread(target=pre, args=(r,), daemon=True) for r in range(size)]
    for t in pre_threads:
        t.start()
    for t in pre_threads:
        t.join(args.run_timeout)
    if errors or any(t.is_alive() for t in pre_threads):
        hub.barrier.abort()
        return {
            "harness": "thread",
            "np": size,
            "error": errors[0] if errors else "lockstep timed out",
        }
    for rt in rts:
        rt.start()

    def body(r):
        try:
            results[r] = run_rank(
                rts[r],
                log if r == 0 else None,
                args.tensors,
                args.hit_steps,
                args.miss_steps,
                args.step_timeout,
            )
        except BaseException as exc:  # reported in the row, with the rank
            errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=body, args=(r,), name=f"cp-rank{r}", daemon=True)
        for r in range(size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + args.run_timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    timed_out = any(t.is_alive() for t in threads)
    if timed_out or errors:
        hub.barrier.abort()  # every runtime's pending collective fails
    for rt in rts:
        rt.stop(10)
    wall = time.perf_counter() - t0
    if timed_out:
        return {
            "harness": "thread",
            "np": size,
            "error": f"timed out after {args.run_timeout:g}s (--run-timeout)",
        }
    if errors:
        return {"harness": "thread", "np": size, "error": errors[0]}
    row = summarize(log, results[0], size, Config().cache_capacity, "thread")
    row.update(lock)
    row["wall_s"] = wall
    return row


# --------------------------------------------------------------------------------------------
# harness 3: one rank whose n-1 peers mirror it (per-rank CPU at any size, no transport)


class MirrorBackend(Backend):
    """Rank 0 of ``size`` ranks whose peers all send exactly what it sends.

    The MIN of identical vectors is the vector and the allgather is ``size`` copies of the
    payload, so the runtime builds the full-size control vector, decodes ``size`` payloads
    and runs the controller over ``size x tensors`` requests -- every rank's CPU work at that
    size -- while no byte moves.  Data collectives leave the tensors as they are."""

    name = "mirror"

    def __init__(self, size: int):
        self.rank, self.size = 0, size
        self.local_rank, self.local_size = 0, size
        self.cross_rank, self.cross_size = 0, 1

    def control_allreduce_min(self, vec):
        return vec

    def _allgather_fixed(self, buf):
        return np.tile(buf, self.size)

    def allreduce_(self, tensor, op):
        pass

    def allgather_bytes(self, send, counts):
        return [send] * self.size

    def broadcast_(self, tensor, root):
        pass

    def alltoall_bytes(self, send, send_counts, recv_counts):
        return send.clone()


def run_mirror_job(size: int, args) -> dict:
    log = CycleLog()
    rt = Runtime(Config(rank=0, size=size), MirrorBackend(size))
    instrument(rt, log)
    rt.start()
    t0 = time.perf_counter()
    result: Dict[str, object] = {}

    def body():
        try:
            result["times"] = run_rank(
                rt, log, args.tensors, args.hit_steps, args.miss_steps, args.step_timeout
            )
        except BaseException as exc:  # reported in the row
            result["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=body, name="cp-mirror", daemon=True)
    t.start()
    t.join(args.run_timeout)
    rt.stop(10)
    if t.is_alive():
        return {
            "harness": "mirror",
            "np": size,
            "error": f"timed out after {args.run_timeout:g}s (--run-timeout)",
        }
    if "error" in result:
        return {"harness": "mirror", "np": size, "error": result["error"]}
    row = summarize(log, result["times"], size, Config().cache_capacity, "mirror")
    row["wall_s"] = time.perf_counter() - t0
    return row


# --------------------------------------------------------------------------------------------
# harness 4: the controller alone (CPU work of one negotiation), no transport


def controller_row(size: int, tensors: int, reps: int) -> dict:
    payloads = []
    for r in range(size):
        reqs = [
            Request(
                f"step0.grad.layer{i}.weight",
                OpType.ALLREDUCE,
                "float32",
                (4,),
                reduce_op=int(ReduceOp.SUM),
            )
            for i in range(tensors)
        ]
        payloads.append(encode_requests(reqs))
    wall, cpu = [], []
    for rep in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        gathered = [decode_requests(p) for p in payloads]
        responses = Controller(size).ingest(gathered, rep)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
        assert len(responses) == tensors, (size, len(responses))
    # the uniform negotiation (every rank asked for the same requests, digests agree): a
    # rank encodes and digests its own list and builds the responses from it, nothing more
    uniform = []
    vec = cv.template(Config().cache_capacity)
    for rep in range(reps):
        c0 = time.thread_time()
        cv.put_digest(vec, encode_requests(reqs))
        responses = Controller(size).ingest_uniform(reqs, rep)
        uniform.append(time.thread_time() - c0)
        assert len(responses) == tensors, (size, len(responses))
    max_len = max(len(p) for p in payloads)
    return {
        "harness": "controller",
        "np": size,
        "requests": size * tensors,
        "uniform_cpu_ms": statistics.median(uniform) * 1e3,
        "payload_bytes_per_rank": max_len,
        "gathered_bytes_per_rank": size * (max_len + 4),
        # CPU time is the number to use on a loaded machine; wall includes preemption
        "decode_ingest_cpu_ms": statistics.median(cpu) * 1e3,
        "decode_ingest_ms": statistics.median(wall) * 1e3,
        "decode_ingest_min_ms": min(wall) * 1e3,
    }


# --------------------------------------------------------------------------------------------
# fits and predictions


def fit(xs: List[float], ys: List[float]) -> Optional[dict]:
    """Least squares of y = a + b*n (linear) and of log y = log c + k log n (power law).

    ``preferred`` is the model with the smaller RMS relative residual on the measured points
    (the power law when the line would predict a value <= 0)."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
    if len(pts) < 3:
        return None
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts], dtype=float)
    b, a = np.polyfit(x, y, 1)
    k, logc = np.polyfit(np.log(x), np.log(y), 1)
    c = math.exp(logc)

    def rel_rms(pred):
        return float(np.sqrt(np.mean(((pred - y) / y) ** 2)))

    lin_err, pow_err = rel_rms(a + b * x), rel_rms(c * x**k)
    # a line that goes negative before the predicted sizes describes noise, not growth
    lin_ok = all(a + b * n > 0 for n in PREDICT_AT)
    out = {
        "points": len(pts),
        "n_range": [int(x.min()), int(x.max())],
        "linear": {"a": float(a), "b": float(b), "rel_rms": lin_err},
        "power": {"c": c, "k": float(k), "rel_rms": pow_err},
        "preferred": "linear" if lin_ok and lin_err <= pow_err else "power",
        "predict": {},
    }
    for n in PREDICT_AT:
        out["predict"][str(n)] = {"linear": float(a + b * n), "power": float(c * n**k)}
    return out


#: (row source, metric) pairs that are fitted
FIT_METRICS = [
    ("process", "miss_negotiation_ms"),
    ("process", "miss_control_allreduce_ms"),
    ("process", "miss_allgather_ms"),
    ("process", "rank0_miss_cycle_cpu_ms"),
    ("process", "hit_control_allreduce_ms"),
    ("process", "rank0_hit_cycle_cpu_ms"),
    ("process", "hit_step_ms"),
    ("process", "miss_step_ms"),
    ("process", "lockstep_control_allreduce_ms"),
    ("process", "lockstep_allgather_ms"),
    ("thread", "miss_negotiation_ms"),
    ("thread", "rank0_miss_cycle_cpu_ms"),
    ("thread", "rank0_hit_cycle_cpu_ms"),
    ("thread", "hit_step_ms"),
    ("thread", "miss_step_ms"),
    ("thread", "lockstep_control_allreduce_ms"),
    ("mirror", "rank0_miss_cycle_cpu_ms"),
    ("mirror", "rank0_hit_cycle_cpu_ms"),
    ("mirror", "miss_decode_ingest_ms"),
    ("controller", "decode_ingest_cpu_ms"),
]


def all_fits(rows: List[dict]) -> Dict[str, dict]:
    fits = {}
    for harness, metric in FIT_METRICS:
        good = [
            r
            for r in rows
            if r["harness"] == harness and "error" not in r and r.get(metric) is not None
        ]
        if harness in ("controller", "mirror"):
            # fit the sizes the jobs reach; sizes beyond are measured, not predicted, and
            # are kept next to the prediction to check the extrapolation
            beyond = {str(r["np"]): r[metric] for r in good if r["np"] in PREDICT_AT}
            good = [r for r in good if r["np"] <= FIT_MAX_NP]
        else:
            beyond = {}
        f = fit([r["np"] for r in good], [r[metric] for r in good])
        if f is not None:
            for n, measured in beyond.items():
                f["predict"][n]["measured"] = measured
            fits[f"{harness}:{metric}"] = f
    return fits


def exact_model(cache_capacity: int, tensors: int, payload_bytes: int) -> List[dict]:
    """Bytes per cycle at each size, from the layouts (hvdlite) and Horovod's design."""
    out = []
    for n in (2, 4, 8, 16, 32, 64) + PREDICT_AT:
        v = control_vector_bytes(n, cache_capacity)
        out.append(
            {
                "np": n,
                "hvdlite_vector_bytes": v,
                # ring allreduce (Gloo's default): each rank sends and receives 2(n-1)/n of it,
                # in at least 2(n-1) neighbour hops one after the other (reduce-scatter, allgather)
                "hvdlite_vector_bytes_on_wire_per_rank": int(2 * (n - 1) / n * v),
                "ring_sequential_hops": 2 * (n - 1),
                # latency-optimal alternatives: recursive doubling, or a binomial reduce + broadcast
                "recursive_doubling_rounds": math.ceil(math.log2(n)),
                "tree_reduce_broadcast_rounds": 2 * math.ceil(math.log2(n)),
                "horovod_bitvector_bytes": horovod_bitvector_bytes(min(tensors, cache_capacity)),
                "horovod_bitvector_bytes_full_cache": horovod_bitvector_bytes(cache_capacity),
                # a miss: hvdlite allgathers every rank's padded payload to every rank
                "hvdlite_miss_bytes_received_per_rank": n * (payload_bytes + 4),
                "hvdlite_miss_bytes_total": n * n * (payload_bytes + 4),
                # Horovod: rank 0 receives every ready list, sends the response list back (under
                # MPI a gather; its Gloo controller uses allgatherv, so every rank receives them)
                "horovod_miss_bytes_received_rank0": (n - 1) * payload_bytes,
                "horovod_gloo_miss_bytes_received_per_rank": n * payload_bytes,
            }
        )
    return out


# --------------------------------------------------------------------------------------------
# output

COLUMNS = [
    ("harness", "src", "{}"),
    ("np", "np", "{}"),
    ("layout", "hosts x slots", "{}"),
    ("cross_min", "cross MIN", "{}"),
    ("vector_bytes", "vec B", "{}"),
    ("uniform_negotiations", "uniform", "{}"),
    ("miss_negotiation_ms", "miss negot ms", "{:.3f}"),
    ("miss_control_allreduce_ms", "ctl AR ms", "{:.3f}"),
    ("miss_allgather_ms", "AG ms", "{:.3f}"),
    ("miss_allgather_bytes", "AG B/rank", "{}"),
    ("miss_decode_ingest_ms", "dec+ctl ms", "{:.3f}"),
    ("rank0_miss_cycle_cpu_ms", "r0 CPU miss", "{:.3f}"),
    ("hit_control_allreduce_ms", "hit ctl AR ms", "{:.3f}"),
    ("rank0_hit_cycle_cpu_ms", "r0 CPU hit", "{:.3f}"),
    ("hit_step_ms", "hit step ms", "{:.2f}"),
    ("miss_step_ms", "miss step ms", "{:.2f}"),
    ("lockstep_control_allreduce_ms", "lockstep AR ms", "{:.3f}"),
    ("lockstep_allgather_ms", "lockstep AG ms", "{:.3f}"),
]


def fmt(value, spec):
    return "-" if value is None else spec.format(value)


def print_cross_min(ratios: List[dict]) -> None:
    print(
        "\ncross-host MIN with shared memory on, medians over repeats (ms), dissemination / ring:"
    )
    print(
        "| hosts x slots | np | runs (ring, diss) | "
        + " | ".join(f"{m} ring | diss | ratio" for m in CROSS_MIN_METRICS)
        + " |"
    )
    print("|---|---|---|" + "---|---|---|" * len(CROSS_MIN_METRICS))
    for e in ratios:
        cells = []
        for m in CROSS_MIN_METRICS:
            cells += [
                fmt(e[f"ring:{m}"], "{:.3f}"),
                fmt(e[f"dissemination:{m}"], "{:.3f}"),
                fmt(e[f"ratio:{m}"], "{:.2f}"),
            ]
        print(
            f"| {e['layout']} | {e['np']} | {e['repeats']['ring']}, "
            f"{e['repeats']['dissemination']} | " + " | ".join(cells) + " |"
        )


def print_table(rows: List[dict], controller: List[dict], fits: Dict[str, dict]) -> None:
    print("| " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        if "error" in r:
            print(f"| {r['harness']} | {r['np']} | error: {r['error'][:200]} |")
            continue
        print("| " + " | ".join(fmt(r.get(k), s) for k, _, s in COLUMNS) + " |")
    if controller:
        print(
            "\ncontroller alone (decode every rank's payload + Controller.ingest; uniform: "
            "encode + digest + Controller.ingest_uniform), ms:"
        )
        print(
            "| np | requests | gathered B/rank | CPU median | wall median | wall min | "
            "uniform CPU |\n|---|---|---|---|---|---|---|"
        )
        for c in controller:
            print(
                f"| {c['np']} | {c['requests']} | {c['gathered_bytes_per_rank']} | "
                f"{c['decode_ingest_cpu_ms']:.3f} | {c['decode_ingest_ms']:.3f} | "
                f"{c['decode_ingest_min_ms']:.3f} | {fmt(c.get('uniform_cpu_ms'), '{:.3f}')} |"
            )
    if fits:
        print(
            "\nfits (linear: a + b*n; power: c * n^k, least squares on log-log); "
            "predictions at " + ", ".join(map(str, PREDICT_AT)) + " ranks:"
        )
        print(
            "| metric | linear a, b (rel rms) | power c, k (rel rms) | preferred | "
            + " | ".join(f"@{n}" for n in PREDICT_AT)
            + " |"
        )
        print("|---|---|---|---|" + "---|" * len(PREDICT_AT))
        for key, f in fits.items():
            lin, pw = f["linear"], f["power"]
            cells = []
            for n in PREDICT_AT:
                pred = f["predict"][str(n)]
                cell = f"{pred[f['preferred']]:.3g}"
                if "measured" in pred:
                    cell += f" (measured {pred['measured']:.3g})"
                cells.append(cell)
            print(
                f"| {key} | {lin['a']:.3g}, {lin['b']:.3g} ({lin['rel_rms']:.2f}) | "
                f"{pw['c']:.3g}, {pw['k']:.2f} ({pw['rel_rms']:.2f}) | {f['preferred']} | "
                + " | ".join(cells)
                + " |"
            )


def plot(path: str, rows: List[dict], controller: List[dict], model: List[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = [
        (
            axes[0][0],
            "negotiation on a cache miss (rank 0, wall ms)",
            [("process", "miss_negotiation_ms"), ("thread", "miss_negotiation_ms")],
        ),
        (
            axes[0][1],
            "steady state, cache hitting (ms)",
            [
                ("process", "hit_control_allreduce_ms"),
                ("process", "lockstep_control_allreduce_ms"),
                ("process", "hit_step_ms"),
                ("thread", "hit_step_ms"),
            ],
        ),
        (
            axes[1][0],
            "rank 0's work per cycle (background-thread CPU ms)",
            [
                ("process", "rank0_miss_cycle_cpu_ms"),
                ("process", "rank0_hit_cycle_cpu_ms"),
                ("thread", "rank0_miss_cycle_cpu_ms"),
                ("thread", "rank0_hit_cycle_cpu_ms"),
                ("mirror", "rank0_miss_cycle_cpu_ms"),
                ("mirror", "rank0_hit_cycle_cpu_ms"),
            ],
        ),
    ]
    for ax, title, series in panels:
        for harness, metric in series:
            pts = [
                (r["np"], r[metric])
                for r in rows
                if r["harness"] == harness and "error" not in r and r.get(metric)
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{harness}: {metric}")
        if ax is axes[1][0] and controller:
            ax.plot(
                [c["np"] for c in controller],
                [c["decode_ingest_cpu_ms"] for c in controller],
                marker="s",
                linestyle="--",
                label="controller alone: decode+ingest CPU",
            )
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[1][1]
    ns = [m["np"] for m in model]
    ax.plot(
        ns,
        [m["hvdlite_vector_bytes"] for m in model],
        marker="o",
        label="hvdlite control vector (per rank)",
    )
    ax.plot(
        ns,
        [m["hvdlite_miss_bytes_received_per_rank"] for m in model],
        marker="o",
        label="hvdlite miss: allgather received per rank",
    )
    ax.plot(
        ns,
        [m["horovod_miss_bytes_received_rank0"] for m in model],
        marker="^",
        label="Horovod miss: gathered at rank 0 (MPI; Gloo: at every rank)",
    )
    ax.plot(
        ns,
        [m["horovod_bitvector_bytes_full_cache"] for m in model],
        marker="^",
        label="Horovod cache bit vector (1024 entries)",
    )
    ax.set_title("bytes per cycle (exact, from the layouts)", fontsize=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("hvdlite control plane vs world size", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------


def parse_sizes(text: str) -> List[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--process-np",
        help="sizes run as real processes (hvdlite-run --no-shared-memory); default 2,4,8,16",
    )
    p.add_argument(
        "--thread-np", help="sizes run as threads over the loopback harness; default 2,4,8,16,32,64"
    )
    p.add_argument(
        "--mirror-np",
        help="sizes run as one rank whose peers mirror it "
        "(per-rank CPU, no transport); default 2,4,...,1024",
    )
    p.add_argument(
        "--controller-np",
        help="sizes for the controller-alone CPU measurement; default 2,4,...,1024",
    )
    p.add_argument("--tensors", type=int, default=16, help="allreduces per step (4 floats each)")
    p.add_argument("--hit-steps", type=int, help="steps answered by the cache (default 30)")
    p.add_argument("--miss-steps", type=int, help="steps with fresh names (default 15)")
    p.add_argument("--controller-reps", type=int, help="repetitions per size (default 7)")
    p.add_argument(
        "--lockstep-reps",
        type=int,
        help="back-to-back control collectives timed before the runtime starts (default 30)",
    )
    p.add_argument(
        "--payload-len",
        type=int,
        default=1015,
        help="bytes per rank in the lockstep allgather (16 requests encode to 1015 bytes)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="seconds one step may take before the job is failed",
    )
    p.add_argument(
        "--run-timeout",
        type=float,
        help="seconds one job (one size of one harness) may take (default 240)",
    )
    p.add_argument(
        "--process-hosts",
        default="",
        help="layouts HOSTSxSLOTS (e.g. 2x2,4x2) run as real processes on loopback "
        "hosts 127.0.0.1..H with shared memory on (needs an sshd listening on "
        "127.0.0.2.. : --ssh-port, --ssh-identity)",
    )
    p.add_argument("--ssh-port", type=int, help="passed to hvdlite-run as --ssh-port")
    p.add_argument("--ssh-identity", help="passed to hvdlite-run as --ssh-identity-file")
    p.add_argument(
        "--cross-min",
        default="dissemination",
        help="how --process-hosts jobs reduce the control vector across hosts: "
        "dissemination, ring, or both (ring,dissemination), each in turn",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="times every --process-hosts layout and --cross-min kind runs",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke-test defaults: thread harness at np=2, no processes, few steps",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="measure nothing: reprint, refit and replot the rows of an earlier --json",
    )
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main(args)
    defaults = dict(
        process_np="2,4,8,16",
        thread_np="2,4,8,16,32,64",
        mirror_np="2,4,8,16,32,64,128,256,512,1024",
        controller_np="2,4,8,16,32,64,128,256,512,1024",
        hit_steps=30,
        miss_steps=15,
        controller_reps=7,
        lockstep_reps=30,
        run_timeout=240.0,
    )
    if args.quick:
        defaults.update(
            process_np="",
            thread_np="2",
            mirror_np="2,8",
            controller_np="2,4,8",
            hit_steps=4,
            miss_steps=3,
            controller_reps=2,
            lockstep_reps=3,
            run_timeout=60.0,
        )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    started = time.perf_counter()
    if args.from_json:
        with open(args.from_json) as f:
            earlier = json.load(f)
        rows, controller = earlier["rows"], earlier["controller"]
        meta = dict(earlier["meta"], refitted_from=os.path.basename(args.from_json))
        return _report(args, rows, controller, meta)
    rows = []
    for n in parse_sizes(args.process_np):
        print(f"# process harness np={n} ...", file=sys.stderr, flush=True)
        rows.append(run_process_job(n, args))
    rows += run_host_jobs(args)
    for n in parse_sizes(args.thread_np):
        print(f"# thread harness np={n} ...", file=sys.stderr, flush=True)
        rows.append(run_thread_job(n, args))
    for n in parse_sizes(args.mirror_np):
        print(f"# mirror harness np={n} ...", file=sys.stderr, flush=True)
        rows.append(run_mirror_job(n, args))
    controller = [
        controller_row(n, args.tensors, args.controller_reps)
        for n in parse_sizes(args.controller_np)
    ]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "tensors_per_step": args.tensors,
        "hit_steps": args.hit_steps,
        "miss_steps": args.miss_steps,
        "cache_capacity": Config().cache_capacity,
        "cycle_time_ms": Config().cycle_time_ms,
        "process_np": parse_sizes(args.process_np),
        "process_hosts": args.process_hosts,
        "cross_min": args.cross_min,
        "repeats": args.repeats,
        "thread_np": parse_sizes(args.thread_np),
        "mirror_np": parse_sizes(args.mirror_np),
        "seconds": time.perf_counter() - started,
    }
    return _report(args, rows, controller, meta)


def _report(args, rows: List[dict], controller: List[dict], meta: dict) -> int:
    """Fit, print, and write the JSON and the plot; the exit status."""
    fits = all_fits(rows + controller)
    payload = controller[0]["payload_bytes_per_rank"] if controller else args.payload_len
    model = exact_model(
        meta.get("cache_capacity", Config().cache_capacity),
        meta.get("tensors_per_step", args.tensors),
        payload,
    )
    print_table(rows, controller, fits)
    ratios = cross_min_ratios(rows)
    if ratios:
        print_cross_min(ratios)
    result = {
        "meta": meta,
        "rows": rows,
        "controller": controller,
        "fits": fits,
        "model": model,
        "cross_min": ratios,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(args.plot, rows, controller, model)
    failed = [r for r in rows if "error" in r]
    return 1 if failed and len(failed) == len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
