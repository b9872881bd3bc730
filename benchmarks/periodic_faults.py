"""Training through periodic faults: an elastic job that loses a worker every few seconds.

    PATH=/work/main/.venv/bin:$PATH .venv/bin/python benchmarks/periodic_faults.py \\
        [--steps N] [--intervals 30 10] [--seed S] [--json F]

Four single-slot "hosts" that are all this machine (distinct names for it taken from
``local_addresses()``: ``localhost``, ``127.0.0.1``, the host name, an interface's
IPv4 address) run an elastic torch job through ``python -m hvdlite.runner.cli.launch``
(``-np 4 --min-np 2 --max-np 4``).  A discovery script always lists all four hosts;
a killed worker's host is blacklisted for 1-2 s (``--blacklist-cooldown-range``),
then discovery offers it again and a replacement worker starts and joins.  This
script is also the training script (``--worker``): an MLP, ``DistributedOptimizer``
over momentum SGD, ``TorchState`` with a commit after every step.

Runs: one fault-free run, then one run per ``--intervals`` value in which a thread
SIGKILLs a random worker every that many seconds (never rank 0, the oldest survivor,
which holds the state; chosen with ``random.Random(--seed)``).  The table compares
steps/s (first to last committed step) with the fault-free run, counts committed
steps lost or repeated (both must be 0) and compares every host's final parameters
with the fault-free run's.  Per fault: kill -> the first step committed after rank 0
is back in training (recovery), split into kill -> rank 0 sees the error, the reset
(shutdown, next rendezvous round), the state broadcast and the step redone; and
kill -> first step back at 4 ranks (regrow).  Because the machine's load moves the
plain steps/s ratio, the time training stood still (``paused``) is also summed and
turned into the ratio a kill every interval would give (``proj``).  The default run
(300 steps, intervals 30 and 10) takes about 4-5 minutes on the 2-core machine; 300
steps leave room for only one or two kills 30 s apart (``--steps 600`` for more).

Determinism.  Step ``s`` always trains on the same 12 samples
(``torch.Generator().manual_seed(seed * 100003 + s)``); rank ``r`` of ``n`` takes
samples ``[12r/n, 12(r+1)/n)`` and the Average allreduce of the equal shares' mean
gradients is the global batch's mean gradient, so the data order does not depend on
who is alive.  Committed steps happen exactly once, a reset restores the last commit
and new workers get rank 0's weights and momentum.  What cannot be made the same is
the world size at each step (it depends on when kills land and when replacements
join), and with it the order in which floats are summed (per-rank means, then the
allreduce), so results agree to rounding, not bitwise; bitwise would need every
per-sample gradient summed in one fixed order whatever the size.  Rounding stays
rounding only if training does not amplify it: with ReLU units a 1e-9 difference
flips a unit near zero now and then, and fault-free runs at 3 and at 4 ranks parted by
3.7e-4 after 60 steps (a single-process replay of either size reproduced it to 1e-8,
so the runtime is exact); with tanh they stay within 1e-7 after 300 steps.  Rank 0
also prints a fingerprint of the weights at every commit, so the report names the
first step where a faulty run parts from the fault-free one.

Times are wall-clock (``time.time()``) across processes on this one machine; the
launcher's own log lines are stamped when they arrive here.  Every run is bounded
(``--timeout``: the launcher and every process under it are killed and the log's tail
printed), and when no step is committed for ``--stall-dump-s`` every worker prints its
threads' stacks into the log (``--keep`` keeps the logs).
"""

import argparse
import collections
import faulthandler
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.abspath(__file__)
GLOBAL_BATCH = 12  # divisible by every world size 1..4
NUM_HOSTS = 4
IN_FEATURES, CLASSES = 256, 10
EQUAL_ATOL = 1e-5
NO_KILL_LAST_S = 10.0  # no kill this close to the end: the replacement must join
TARGETS = {30.0: 0.98, 10.0: 0.90}


# -- the training script (run by the launcher) -------------------------------------------------
def _say(tag: str, **fields) -> None:
    """One parseable line on stdout; the launcher forwards it with a rank prefix."""
    body = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"{tag} t={time.time():.6f} {body}", flush=True)


def _shard(seed: int, step: int, rank: int, size: int):
    """This rank's equal share of step ``step``'s global batch, the same at any size."""
    import torch

    gen = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=gen)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=gen)
    lo, hi = rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size
    return x[lo:hi], y[lo:hi]


def _model(seed: int, hidden: int, layers: int):
    """The MLP; its width and depth set how long a step takes.  Tanh, not ReLU: a ReLU's
    kink turns a rounding-sized difference into a flipped unit, so runs at different world
    sizes would part far beyond rounding and the final comparison would say nothing."""
    import torch

    torch.manual_seed(seed)
    mods, width = [], IN_FEATURES
    for _ in range(layers):
        mods += [torch.nn.Linear(width, hidden), torch.nn.Tanh()]
        width = hidden
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, CLASSES))


def _save_final(model, outdir: str, host: str) -> None:
    """Write the parameters by host, since a host's rank changes across resets."""
    import torch

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    path = os.path.join(outdir, f"final-{host}.pt")
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(flat, tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def _fingerprint(model):
    """A cheap fingerprint of the weights, to find the first step where two runs part: a
    fixed +-1 projection of every 997th weight.  Measured here, rounding moved it by at
    most 2e-7 over 300 steps, one training step by 1e-3 (median)."""
    import torch

    gen = torch.Generator().manual_seed(7)
    picks = []
    for p in model.parameters():
        idx = torch.arange(0, p.numel(), 997)
        picks.append((p, idx, torch.randint(0, 2, (len(idx),), generator=gen).double() * 2 - 1))
    return lambda: sum(
        float((p.detach().flatten()[i].double() * sign).sum()) for p, i, sign in picks
    )


def worker(args) -> None:
    """Train ``args.steps`` committed steps; rank 0 reports every commit and reset."""
    import torch

    import hvdlite.torch as hvd
    from hvdlite.common.exceptions import HostsUpdatedInterrupt, HvdliteInternalError

    host = os.environ.get("HVDLITE_HOSTNAME", socket.gethostname())
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the orchestrator's StallWatch
    _say("WORKER", pid=os.getpid(), host=host)
    torch.set_num_threads(1)
    hvd.init()
    model = _model(args.seed, args.hidden, args.layers)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    state = hvd.elastic.TorchState(model, opt, step=0)
    fingerprint = _fingerprint(model)
    state.register_reset_callbacks(
        [lambda: hvd.rank() == 0 and _say("RESET", size=hvd.size(), pid=os.getpid())]
    )

    def commit_and_report():
        # commit() saves first and may raise afterwards (new hosts, a peer lost in its
        # check): the step is committed either way, so report it either way
        try:
            state.commit()
        finally:
            if hvd.rank() == 0:
                _say(
                    "STEP",
                    size=hvd.size(),
                    step=state.step - 1,
                    pid=os.getpid(),
                    sum=f"{fingerprint():.12e}",
                )

    @hvd.elastic.run
    def train(state):
        _say("ENTER", pid=os.getpid(), rank=hvd.rank(), size=hvd.size())
        try:
            while state.step < args.steps:
                x, y = _shard(args.seed, state.step, hvd.rank(), hvd.size())
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                state.step += 1
                commit_and_report()
        except (HvdliteInternalError, HostsUpdatedInterrupt) as exc:
            if hvd.rank() == 0:
                kind = "interrupt" if isinstance(exc, HostsUpdatedInterrupt) else "error"
                _say("FAULT", kind=kind, pid=os.getpid())
            raise

    train(state)
    _save_final(model, args.outdir, host)
    if hvd.rank() == 0:
        _say("DONE", pid=os.getpid())
    hvd.shutdown()


# -- the orchestrator: hosts and the job -------------------------------------------------------
def pick_hosts() -> list:
    """Four names for this machine, so the launcher starts every "host" locally."""
    from hvdlite.runner.hosts.slots import local_addresses

    names = local_addresses()
    ipv4 = sorted(n for n in names if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", n))
    preferred = (
        ["localhost", "127.0.0.1", socket.gethostname()]
        + [a for a in ipv4 if a != "127.0.0.1"]
        + sorted(names)
    )
    hosts = []
    for name in preferred:
        if name in names and ":" not in name and name not in hosts:  # no IPv6
            hosts.append(name)
    if len(hosts) < NUM_HOSTS:
        sys.exit(
            f"periodic_faults: need {NUM_HOSTS} distinct names for this machine "
            f"(host names or IPv4 addresses), found only {hosts}; add an address to "
            f"an interface (e.g. 'ip addr add 127.0.0.2/8 dev lo') and retry"
        )
    return hosts[:NUM_HOSTS]


_PAT = {
    "STEP": re.compile(r"STEP t=([\d.]+) size=(\d+) step=(\d+) pid=(\d+)(?: sum=(\S+))?"),
    "WORKER": re.compile(r"WORKER t=([\d.]+) pid=(\d+) host=(\S+)"),
    "ENTER": re.compile(r"ENTER t=([\d.]+) pid=(\d+) rank=(\d+) size=(\d+)"),
    "FAULT": re.compile(r"FAULT t=([\d.]+) kind=(\w+)"),
    "RESET": re.compile(r"RESET t=([\d.]+) size=(\d+)"),
    "DONE": re.compile(r"DONE t=([\d.]+)"),
}
_DRIVER = re.compile(r"^hvdlite-run: .*(blacklisting|cooldown over|->)")


class Job:
    """One launcher run; a reader thread keeps its log and what its lines say."""

    def __init__(
        self, workdir: str, hosts: list, worker_args: list, name: str, log_level: str = "WARNING"
    ):
        self.outdir = os.path.join(workdir, name)
        os.makedirs(self.outdir)
        script = os.path.join(workdir, "discover.sh")
        with open(script, "w") as f:
            f.write("#!/bin/sh\n" + "".join(f"echo {h}:1\n" for h in hosts))
        os.chmod(script, 0o755)
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.lock = threading.Lock()
        self.steps, self.faults, self.resets, self.driver, self.enters0 = [], [], [], [], []
        self.hosts_of, self.entered, self.done, self.sums = {}, set(), False, {}
        cmd = [
            sys.executable,
            "-m",
            "hvdlite.runner.cli.launch",
            "-np",
            str(NUM_HOSTS),
            "--min-np",
            "2",
            "--max-np",
            str(NUM_HOSTS),
            "--host-discovery-script",
            script,
            "--blacklist-cooldown-range",
            "1",
            "2",
            "--reset-limit",
            "10000",
            "--log-level",
            log_level,
            sys.executable,
            HERE,
            "--worker",
            "--outdir",
            self.outdir,
            *worker_args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        """Copy the launcher's output to the log, parsing each line as it arrives."""
        with open(self.log_path, "w") as log:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                log.write(line)
                log.flush()
                self._parse(time.time(), line)

    def _parse(self, arrived: float, line: str) -> None:
        """Record the events a worker or the driver reports in ``line``."""
        with self.lock:
            if m := _PAT["STEP"].search(line):
                self.steps.append((float(m[1]), int(m[2]), int(m[3]), int(m[4])))
                if m[5]:
                    self.sums[int(m[3])] = float(m[5])
            elif m := _PAT["WORKER"].search(line):
                self.hosts_of[int(m[2])] = m[3]
            elif m := _PAT["ENTER"].search(line):
                self.entered.add(int(m[2]))
                if m[3] == "0":
                    self.enters0.append((float(m[1]), int(m[4])))
            elif m := _PAT["FAULT"].search(line):
                self.faults.append((float(m[1]), m[2]))
            elif m := _PAT["RESET"].search(line):
                self.resets.append((float(m[1]), int(m[2])))
            elif _PAT["DONE"].search(line):
                self.done = True
            elif _DRIVER.search(line):
                self.driver.append((arrived, line.strip()))

    def tail(self, chars: int = 4000) -> str:
        """The end of the log, for error messages."""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def worker_pids(self) -> set:
        """Live processes of this job that are our worker (not the launcher or a wrapper)."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return set()
        with self.lock:
            known = set(self.hosts_of)
        return {k.pid for k in kids if k.pid in known and _alive(k)}

    def finish(self, timeout_s: float) -> int:
        """Wait for the launcher; on timeout kill the whole job and raise with the log tail."""
        code = None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also on Ctrl-C: nothing may outlive the run
            self.kill_all()
        self.reader.join(10)
        if code is None:
            raise RuntimeError(
                f"the job did not finish within {timeout_s:.0f}s; log tail:\n{self.tail()}"
            )
        return code

    def kill_all(self) -> None:
        """End the launcher's group and every process it started (workers have sessions of
        their own), so that nothing outlives the run.  Once the launcher has been reaped its
        pid may belong to someone else, so then there is nothing to do: its workers die
        with it (the runtime's lifeline)."""
        import psutil

        if self.proc.poll() is not None:
            return
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()


def _alive(proc) -> bool:
    """True for a running process (not a zombie) that still exists."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- the killer ---------------------------------------------------------------------------------
class Killer(threading.Thread):
    """Every ``interval`` seconds SIGKILL one random worker that is training and not rank 0."""

    def __init__(self, job: Job, interval: float, rng: random.Random, steps: int):
        super().__init__(daemon=True)
        self.job, self.interval, self.rng, self.total = job, interval, rng, steps
        self.kills, self.stop = [], threading.Event()

    def _victims(self):
        """Workers that have joined training, alive, other than the current rank 0."""
        with self.job.lock:
            entered = set(self.job.entered)
            rank0 = self.job.steps[-1][3] if self.job.steps else None
        return sorted((entered & self.job.worker_pids()) - {rank0})

    def _near_end(self) -> bool:
        """True when the job will likely finish within NO_KILL_LAST_S: a worker killed once
        its peers have exited 0 would fail the job rather than test recovery, and one
        killed shortly before leaves its host without a replacement (and a final file)."""
        with self.job.lock:
            steps = list(self.job.steps)
        if len(steps) < 20:
            return False
        rate = 20 / max(steps[-1][0] - steps[-21][0], 1e-6)
        return (self.total - 1 - steps[-1][2]) / rate < NO_KILL_LAST_S

    def run(self) -> None:
        while not self.job.steps and not self.stop.wait(0.05):
            pass
        due = time.time() + self.interval
        while not self.stop.wait(max(0.0, due - time.time())):
            if self.job.done or self._near_end():
                return
            victims = self._victims()
            if not victims:  # everyone but rank 0 still joining: try shortly
                due = time.time() + 0.2
                continue
            pid = self.rng.choice(victims)
            with self.job.lock:
                last, host = self.job.steps[-1], self.job.hosts_of.get(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                due = time.time() + 0.2
                continue
            self.kills.append(
                {"t": time.time(), "pid": pid, "host": host, "size": last[1], "last_step": last[2]}
            )
            due += self.interval


class StallWatch(threading.Thread):
    """Once per stall (no committed step for ``after_s``) make every live worker print its
    Python stacks (SIGUSR2, faulthandler), so that a hang explains itself in the log.  Not
    the launcher's SIGUSR1 report: that one needs rank 0 to answer, and rank 0 may be the
    one that is stuck."""

    def __init__(self, job: Job, after_s: float):
        super().__init__(daemon=True)
        self.job, self.after_s = job, after_s
        self.dumps, self.stop = [], threading.Event()

    def run(self) -> None:
        asked_for = None  # the last step before the stall already reported
        while not self.stop.wait(0.5):
            with self.job.lock:
                last = self.job.steps[-1][0] if self.job.steps else None
            if last is None or self.job.done or last == asked_for:
                continue
            if time.time() - last > self.after_s:
                pids = sorted(self.job.worker_pids())
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGUSR2)
                    except ProcessLookupError:
                        pass
                self.dumps.append(
                    {"t": time.time(), "since_last_step_s": time.time() - last, "pids": pids}
                )
                asked_for = last


# -- analysis -----------------------------------------------------------------------------------
def _first_after(events, t, pred=lambda e: True):
    """The first event (tuple whose [0] is a time) after ``t`` that satisfies ``pred``."""
    return next((e for e in events if e[0] > t and pred(e)), None)


def fault_breakdown(job: Job, kills: list) -> list:
    """Per kill: recovery (kill -> first step committed after rank 0 re-entered training)
    and its parts, and the regrowth to 4 ranks (seconds).

    A kill that lands while rank 0 is outside its training loop (resetting, or syncing
    the state) has no ``detect``: rank 0 meets the error where this script cannot print it,
    and the time is in ``reset``."""
    steps, faults = sorted(job.steps), sorted(job.faults)
    resets, enters = sorted(job.resets), sorted(job.enters0)
    out = []
    for i, k in enumerate(kills):
        t = k["t"]
        nxt = kills[i + 1]["t"] if i + 1 < len(kills) else math.inf
        prev = max((s for s in steps if s[0] <= t), default=None)
        reset = _first_after(resets, t)
        fault = _first_after(faults, t, lambda e: reset is None or e[0] <= reset[0])
        enter = _first_after(enters, reset[0]) if reset else None
        first = _first_after(steps, enter[0]) if enter else None
        regrow = (
            _first_after(steps, first[0] - 1e-9, lambda e: e[1] == NUM_HOSTS) if first else None
        )
        driver = _first_after(job.driver, t, lambda e: "blacklisting" in e[1])
        row = dict(
            k,
            recovery_s=_diff(first, t),
            work_lost_s=_diff(t, prev),
            detect_s=_diff(fault, t),
            driver_saw_s=_diff(driver, t),
            reset_s=_diff(reset, fault or t),
            sync_s=_diff(enter, reset),
            redo_s=_diff(first, enter),
            size_after=enter[1] if enter else None,
            regrow_s=_diff(regrow, t) if regrow and regrow[0] < nxt else None,
        )
        if row["regrow_s"] is not None:  # the growth reset's own pause
            before = max(s for s in steps if s[0] < regrow[0])
            row["regrow_pause_s"] = regrow[0] - before[0]
        out.append(row)
    return out


def first_divergence(run: dict, base: dict, atol: float = EQUAL_ATOL):
    """The first committed step whose weight fingerprint differs from the fault-free run's
    by more than rounding, with the size it ran at; None if all agree."""
    for step in sorted(run["sums"]):
        ref = base["sums"].get(step)
        if ref is not None and abs(run["sums"][step] - ref) > atol:
            return {
                "step": step,
                "size": run["step_sizes"].get(step),
                "sum": run["sums"][step],
                "ref": ref,
            }
    return None


def _diff(a, b):
    """``a - b`` for times or events (their [0]); None when either is missing."""
    if a is None or b is None:
        return None
    a = a[0] if isinstance(a, tuple) else a
    b = b[0] if isinstance(b, tuple) else b
    return a - b


def compare_params(outdir: str, reference) -> dict:
    """Max |difference| of each host's final parameters from the reference vector."""
    import torch

    result = {}
    for name in sorted(os.listdir(outdir)):
        if name.startswith("final-") and name.endswith(".pt"):
            flat = torch.load(os.path.join(outdir, name)).double()
            host = name[len("final-") : -len(".pt")]
            result[host] = (
                float((flat - reference).abs().max()) if flat.shape == reference.shape else math.inf
            )
    return result


def paused_s(ordered: list, medians: dict) -> float:
    """Seconds training stood still: every gap between committed steps longer than 1.5x
    the run's median step at that size, less that median.  Unlike the wall time it does
    not move with the machine's load, nor with steps at 3 ranks being cheaper than at 4
    when 4 processes share 2 cores."""
    total = 0.0
    for a, b in zip(ordered, ordered[1:]):
        typical = medians.get(b[1]) or medians.get(NUM_HOSTS) or 0.0
        if b[0] - a[0] > 1.5 * typical:
            total += b[0] - a[0] - typical
    return total


def summarize(job: Job, steps: int, kills: list) -> dict:
    """Throughput, step accounting and per-fault times of one finished run."""
    counts = collections.Counter(s[2] for s in job.steps)
    times = sorted(s[0] for s in job.steps)
    wall = times[-1] - times[0] if len(times) > 1 else math.nan
    ordered = sorted(job.steps)
    gaps = {}  # step times at each size, from back-to-back steps
    for a, b in zip(ordered, ordered[1:]):
        if a[1] == b[1] and b[2] == a[2] + 1:
            gaps.setdefault(b[1], []).append(b[0] - a[0])
    medians = {n: statistics.median(g) for n, g in sorted(gaps.items())}
    return {
        "wall_s": wall,
        "steps_per_s": (len(times) - 1) / wall if wall > 0 else math.nan,
        "kills": len(kills),
        "paused_s": paused_s(ordered, medians),
        "steps_lost": sorted(set(range(steps)) - set(counts)),
        "steps_repeated": sorted(s for s, c in counts.items() if c > 1),
        "median_step_s": medians,
        "max_gap_s": max((b - a for a, b in zip(times, times[1:])), default=None),
        "sizes": {
            n: sum(1 for s in job.steps if s[1] == n) for n in sorted({s[1] for s in job.steps})
        },
        "faults": fault_breakdown(job, kills),
    }


def run_one(workdir, hosts, args, interval, name) -> dict:
    """Launch one job (with a killer if ``interval``), wait for it, and summarize it."""
    worker_args = [
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--lr",
        str(args.lr),
    ]
    started = time.time()
    job = Job(workdir, hosts, worker_args, name, args.log_level)
    killer = Killer(job, interval, random.Random(args.seed), args.steps) if interval else None
    watch = StallWatch(job, args.stall_dump_s) if args.stall_dump_s else None
    helpers = [h for h in (killer, watch) if h]
    for helper in helpers:
        helper.start()
    try:
        code = job.finish(args.timeout)
    finally:
        for helper in helpers:
            helper.stop.set()
            helper.join(5)
    if code != 0 or not job.done:
        raise RuntimeError(
            f"run {name}: the launcher exited with {code} "
            f"(DONE {'seen' if job.done else 'not seen'}); log tail:\n{job.tail()}"
        )
    result = summarize(job, args.steps, killer.kills if killer else [])
    result.update(
        name=name,
        interval_s=interval,
        elapsed_s=time.time() - started,
        log=job.log_path,
        outdir=job.outdir,
        sums=job.sums,
        step_sizes={s[2]: s[1] for s in job.steps},
        stack_dumps=watch.dumps if watch else [],
    )
    return result


# -- the report ---------------------------------------------------------------------------------
def _fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def print_report(runs: list, hosts: list) -> None:
    """The table, the per-fault times and the determinism note."""
    base = runs[0]
    print(
        f"\nhosts {', '.join(hosts)}; {len(base['params'])} final files per run compared "
        f"with the fault-free run's {hosts[0]} (rank 0) file"
    )
    print(
        f"{'run':>12} {'wall s':>7} {'steps/s':>8} {'ratio':>6} {'target':>7} {'kills':>5} "
        f"{'paused s':>8} {'proj':>6} {'lost':>4} {'rep':>4} {'step@4 ms':>9} {'max gap s':>9} "
        f"{'max |dp|':>9} params"
    )
    for r in runs:
        target = TARGETS.get(r["interval_s"])
        ratio = r["steps_per_s"] / base["steps_per_s"]
        verdict = "" if target is None else (" MET" if ratio >= target else " MISSED")
        proj = _projected(r)
        dp = max(r["params"].values(), default=math.inf)
        missing = sorted(set(hosts) - set(r["params"]))
        equal = ("equal" if dp <= EQUAL_ATOL else "DIFFER") + (
            f" (no final file from {', '.join(missing)})" if missing else ""
        )
        step4 = _ms(r["median_step_s"].get(NUM_HOSTS))
        print(
            f"{r['name']:>12} {r['wall_s']:7.1f} {r['steps_per_s']:8.3f} {ratio:6.3f} "
            f"{_fmt(target, '.2f'):>7}{verdict:7} {r['kills']:5d} {r['paused_s']:8.2f} "
            f"{_fmt(proj, '.3f'):>6} {len(r['steps_lost']):4d} "
            f"{len(r['steps_repeated']):4d} {_fmt(step4, '.0f'):>9} "
            f"{_fmt(r['max_gap_s']):>9} {dp:9.2e} {equal}"
        )
    for r in runs[1:]:
        print(
            f"\n{r['name']}: per fault (s): kill -> rank 0 sees the error (detect), -> it is "
            f"in the next round (reset), -> state broadcast (sync), -> step committed (redo); "
            f"driver = kill -> the launcher's blacklisting line; lost = last commit -> kill; "
            f"regrow = kill -> first step at {NUM_HOSTS} ranks; grow pause = the step gap "
            f"around that growth"
        )
        print(
            f"  {'#':>2} {'host':>10} {'size':>7} {'recovery':>8} {'detect':>6} "
            f"{'driver':>6} {'reset':>6} {'sync':>6} {'redo':>6} {'lost':>6} {'regrow':>7} "
            f"{'grow pause':>10}"
        )
        for i, f in enumerate(r["faults"]):
            sizes = f"{f['size']}->{_fmt(f['size_after'], 'd')}"
            print(
                f"  {i + 1:2d} {str(f['host']):>10} {sizes:>7} {_fmt(f['recovery_s']):>8} "
                f"{_fmt(f['detect_s']):>6} {_fmt(f['driver_saw_s']):>6} {_fmt(f['reset_s']):>6} "
                f"{_fmt(f['sync_s']):>6} {_fmt(f['redo_s']):>6} {_fmt(f['work_lost_s']):>6} "
                f"{_fmt(f['regrow_s']):>7} {_fmt(f.get('regrow_pause_s')):>10}"
            )
        if r["stack_dumps"]:
            print(
                f"  STALLS: {len(r['stack_dumps'])} times no step for "
                f"{r['stack_dumps'][0]['since_last_step_s']:.0f}+ s; every worker's stacks "
                f"(faulthandler, on stderr) are in {r['log']}"
            )
        print(
            f"  first step whose weights part from the fault-free run's (fingerprint): "
            f"{r['first_divergence'] or 'none'}"
        )
        rec = [f["recovery_s"] for f in r["faults"] if f["recovery_s"] is not None]
        grow = [f["regrow_s"] for f in r["faults"] if f["regrow_s"] is not None]
        per_kill = r["paused_s"] / r["kills"] if r["kills"] else None
        print(
            f"  recovery median {_fmt(_median(rec))} s, max {_fmt(max(rec, default=None))} s; "
            f"regrow median {_fmt(_median(grow))} s; paused {r['paused_s']:.2f} s in all "
            f"({_fmt(per_kill)} s per kill); wall time {r['wall_s'] - base['wall_s']:+.1f} s "
            f"against the fault-free run; steps at each size {r['sizes']}, median step ms "
            f"at each size { {n: round(v * 1000) for n, v in r['median_step_s'].items()} }"
        )
    print(
        "\nratio = steps/s over the fault-free run's (moves with the machine's load: compare "
        "the step@4 column); proj = 1 - (pause per kill) / interval, the same ratio from the "
        "pauses alone; paused = step gaps beyond 1.5x the median step, less the median."
    )
    print(
        "Determinism: data, sharding, initial weights and the committed steps are fixed by the "
        "seed; the world size at each step is not (it depends on when kills land and "
        "replacements join), so the float summation order differs and final parameters agree "
        f"to rounding (atol {EQUAL_ATOL:g}), not bitwise.  The MLP uses tanh: with ReLU, "
        "rounding-sized differences flip units and runs at different sizes part by ~1e-3."
    )


def _projected(run: dict):
    """Throughput ratio if every ``interval`` costs the run's mean pause per kill: 1 - P/T."""
    if not run["kills"] or not run["interval_s"]:
        return None
    return 1.0 - run["paused_s"] / run["kills"] / run["interval_s"]


def _ms(v):
    return None if v is None else v * 1000


def _median(values):
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="committed steps per run")
    p.add_argument(
        "--intervals",
        type=float,
        nargs="*",
        default=[30.0, 10.0],
        help="seconds between kills, one faulty run each (none: fault-free only)",
    )
    p.add_argument("--interval", type=float, help="one interval: --intervals X")
    p.add_argument("--seed", type=int, default=1234, help="data, weights and victim choice")
    p.add_argument("--hidden", type=int, default=2048, help="MLP width")
    p.add_argument("--layers", type=int, default=6, help="MLP hidden layers")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per run before it is killed (default 120 + 1 s per step)",
    )
    p.add_argument("--log-level", default="WARNING", help="the launcher's --log-level")
    p.add_argument(
        "--stall-dump-s",
        type=float,
        default=5.0,
        help="after this long without a committed step, make every worker print its "
        "stacks (into the log; use --keep to read it); 0: never",
    )
    p.add_argument("--json", metavar="FILE", help="write everything as JSON")
    p.add_argument("--keep", action="store_true", help="keep the logs and final files")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--outdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.timeout = args.timeout or 120.0 + args.steps
    if args.interval:
        args.intervals = [args.interval]
    hosts = pick_hosts()
    print(
        f"periodic_faults: {args.steps} steps, kills every {args.intervals} s, seed "
        f"{args.seed}, hosts {hosts}",
        flush=True,
    )
    workdir = tempfile.mkdtemp(prefix="periodic_faults-")
    started, runs, error = time.time(), [], None
    try:
        runs = run_all(workdir, hosts, args)
        print_report(runs, hosts)
    except RuntimeError as exc:  # a run failed or hung: its log tail says why
        error = str(exc)
        print(f"\nperiodic_faults: {error}", file=sys.stderr)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "hosts": hosts,
                        "steps": args.steps,
                        "seed": args.seed,
                        "hidden": args.hidden,
                        "layers": args.layers,
                        "lr": args.lr,
                        "targets": TARGETS,
                        "runs": runs,
                        "error": error,
                    },
                    f,
                    indent=2,
                    default=str,
                )
        if args.keep or error:
            print(f"\ntotal {time.time() - started:.0f} s; logs and final files in {workdir}")
        else:
            print(f"\ntotal {time.time() - started:.0f} s")
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if error else 0


def run_all(workdir: str, hosts: list, args) -> list:
    """The fault-free run, then one run per interval; every run's parameters compared."""
    import torch

    runs = []
    plan = [("fault-free", 0.0)] + [(f"every {i:g}s", i) for i in args.intervals]
    for n, (name, interval) in enumerate(plan):
        if [p[0] for p in plan].count(name) > 1:  # the same interval twice
            name = f"{name} #{n}"
        r = run_one(workdir, hosts, args, interval, re.sub(r"[ #]+", "_", name))
        r["name"] = name
        runs.append(r)
        print(
            f"{name}: {r['wall_s']:.1f} s training, {r['steps_per_s']:.3f} steps/s, "
            f"{r['kills']} kills ({r['elapsed_s']:.0f} s with start-up)",
            flush=True,
        )
        if interval and not r["kills"]:
            print(
                f"  (no kill: the first is due {interval:g} s after the first step and none "
                f"comes in the last {NO_KILL_LAST_S:g} s; use more --steps)",
                flush=True,
            )
    reference = torch.load(os.path.join(runs[0]["outdir"], f"final-{hosts[0]}.pt")).double()
    for r in runs:
        r["params"] = compare_params(r["outdir"], reference)
        r["first_divergence"] = first_divergence(r, runs[0])
    return runs


if __name__ == "__main__":
    sys.exit(main())
