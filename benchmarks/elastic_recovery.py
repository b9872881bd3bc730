"""How fast an elastic job recovers: from a worker's death, and from a new host, to training.

    .venv/bin/python benchmarks/elastic_recovery.py [--runs 5] [--json FILE]

It launches ``hvdlite-run`` itself (np=3 by default) with a discovery script that
reads a file, and runs its own ``--worker`` mode as the training script:

* **death -> first step**: a worker (the single slot of host ``127.0.0.1``) prints
  the time and SIGKILLs itself in the middle of a step's gradient allreduce; the
  number is the time until rank 0 completes its first step in the smaller world.
* **new host -> first step**: the job starts on ``localhost`` only; once it trains
  the benchmark adds ``127.0.0.1`` to the discovery file; the number is the time
  until rank 0 completes its first step in the larger world (the driver polls
  discovery about once a second, which is part of it; the job runs with
  ``--discovery-settle-seconds 0``, so the default 5 s a new host waits to settle is
  not in it).

Each is measured ``--runs`` times; the table shows median, min and max seconds
against the 5 s target.  Times are wall-clock (``time.time()``) across processes
on this one machine.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
TARGET_S = 5.0


# -- the training script (run by hvdlite-run) ------------------------------------------------
def worker(kill_at: int, steps: int, sleep_s: float) -> None:
    import torch

    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model, opt, step=0)
    victim = (os.environ.get("HVDLITE_HOSTNAME"), os.environ.get("HVDLITE_LOCAL_RANK")) == (
        "127.0.0.1",
        "0",
    )

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if victim and state.step == kill_at:
                print(f"DYING t={time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            if hvd.rank() == 0:
                print(f"STEP t={time.time():.6f} size={hvd.size()} step={state.step}", flush=True)
            state.step += 1
            time.sleep(sleep_s)
            state.commit()

    train(state)
    hvd.shutdown()


# -- the orchestrator ----------------------------------------------------------------------------
class _Job:
    def __init__(self, workdir: str, hosts: str, np: int, max_np: int, worker_args):
        self.hosts = os.path.join(workdir, "hosts.txt")
        with open(self.hosts, "w") as f:
            f.write(hosts)
        script = os.path.join(workdir, "discover.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\ncat {self.hosts}\n")
        os.chmod(script, 0o755)
        self.log = os.path.join(workdir, f"job{time.monotonic_ns()}.out")
        cmd = [
            sys.executable,
            "-m",
            "hvdlite.runner.cli.launch",
            "-np",
            str(np),
            "--min-np",
            "1",
            "--max-np",
            str(max_np),
            "--host-discovery-script",
            script,
            # the mechanism's own time: a new host is not held back to settle first
            "--discovery-settle-seconds",
            "0",
            sys.executable,
            HERE,
            "--worker",
            *worker_args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def steps(self):
        return [
            (float(t), int(n))
            for t, n in re.findall(r"STEP t=([\d.]+) size=(\d+) step=\d+", self.text())
        ]

    def wait(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.proc.poll() is not None and not predicate():
                raise RuntimeError(f"the job ended before {what}:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s:.0f}s:\n{self.text()[-3000:]}")
            time.sleep(0.02)

    def finish(self, timeout_s: float = 120.0) -> None:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise RuntimeError(f"the job did not finish:\n{self.text()[-3000:]}") from None
        if code != 0:
            raise RuntimeError(f"the job exited with {code}:\n{self.text()[-3000:]}")


def measure_death(workdir: str, np: int) -> float:
    job = _Job(
        workdir, f"localhost:{np - 1}\n127.0.0.1:1\n", np, np, ["--kill-at", "20", "--steps", "60"]
    )
    job.wait(lambda: "DYING" in job.text(), 120, "the worker's death")
    died = float(re.search(r"DYING t=([\d.]+)", job.text()).group(1))
    job.wait(
        lambda: any(t > died and n == np - 1 for t, n in job.steps()),
        60,
        "a step in the smaller world",
    )
    first = min(t for t, n in job.steps() if t > died and n == np - 1)
    job.finish()
    return first - died


def measure_growth(workdir: str, np: int) -> float:
    job = _Job(
        workdir,
        f"localhost:{np - 1}\n",
        np - 1,
        np,
        ["--kill-at", "-1", "--steps", "400", "--sleep", "0.01"],
    )
    job.wait(lambda: len(job.steps()) >= 20, 120, "20 steps")
    added = time.time()
    with open(job.hosts, "w") as f:
        f.write(f"localhost:{np - 1}\n127.0.0.1:1\n")
    job.wait(lambda: any(n == np for _, n in job.steps()), 60, "a step in the larger world")
    first = min(t for t, n in job.steps() if n == np)
    os.killpg(job.proc.pid, signal.SIGTERM)  # the rest of the run is not needed
    job.proc.wait(30)
    return first - added


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--np", type=int, default=3, help="world size before the death / after growth")
    p.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=60, help=argparse.SUPPRESS)
    p.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.kill_at, args.steps, args.sleep)
        return 0
    results = {"death_to_first_step_s": [], "new_host_to_first_step_s": []}
    with tempfile.TemporaryDirectory() as workdir:
        for run in range(args.runs):
            results["death_to_first_step_s"].append(measure_death(workdir, args.np))
            results["new_host_to_first_step_s"].append(measure_growth(workdir, args.np))
            print(
                f"run {run + 1}/{args.runs}: death {results['death_to_first_step_s'][-1]:.2f}s"
                f", new host {results['new_host_to_first_step_s'][-1]:.2f}s",
                flush=True,
            )
    print(f"\nnp={args.np}, {args.runs} runs each (seconds)")
    print(f"{'measurement':28} {'median':>7} {'min':>7} {'max':>7}   target")
    for name, values in results.items():
        med = statistics.median(values)
        verdict = "MET" if med < TARGET_S else "MISSED"
        print(
            f"{name:28} {med:7.2f} {min(values):7.2f} {max(values):7.2f}   "
            f"< {TARGET_S:g} s -> {verdict}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"np": args.np, "runs": args.runs, "target_s": TARGET_S, "results": results},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
