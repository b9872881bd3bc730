"""Elastic jobs through the real launcher: hvdlite-run --min-np/--max-np/--host-discovery-script.

Hosts are local names (``localhost`` and ``127.0.0.1`` are two hosts to the
driver); one case reaches ``127.0.0.2`` through the real sshd.  Every worker runs
tests/elastic/workers/elastic_train.py, whose result must equal the failure-free
reference however the job was resized.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests import launching
from tests.common.conftest import ROOT
from tests.elastic.conftest import WORKERS, check_result
from tests.runner.conftest import procs_with, wait_gone

pytestmark = pytest.mark.timeout(180)

STEPS = 30
TRAIN = os.path.join(WORKERS, "elastic_train.py")
#: two local hosts to the driver: localhost with 2 slots, 127.0.0.1 with 1
HOSTS3 = "localhost:2\n127.0.0.1:1\n"
NP3 = ["-np", "3", "--min-np", "2", "--max-np", "3"]


class Job:
    """hvdlite-run as a real process; its output goes to a file the test can poll."""

    def __init__(self, tmp_path, hosts, flags, env=None, steps=STEPS, command=None):
        self.hosts_file = tmp_path / "hosts.txt"
        self.hosts_file.write_text(hosts)
        script = tmp_path / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        script.chmod(0o755)
        self.result = tmp_path / "result.json"
        self.out = tmp_path / "launcher.out"
        full_env = {
            "PYTHONUNBUFFERED": "1",
            "ELASTIC_STEPS": str(steps),
            "ELASTIC_OUT": str(self.result),
            **(env or {}),
        }
        with open(self.out, "wb") as out:
            self.proc = launching.start(
                [*flags, "--host-discovery-script", script, *(command or [sys.executable, TRAIN])],
                env=full_env,
                pythonpath=[ROOT],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=False,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, text, count=1, timeout_s=60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.output().count(text) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {count} x {text!r} in the job's output:\n{self.output()}")
            time.sleep(0.05)

    def finish(self, timeout_s=120.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"the job did not finish:\n{self.output()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(*args, **kwargs):
        jobs.append(Job(tmp_path, *args, **kwargs))
        return jobs[-1]

    yield make
    for job in jobs:
        job.kill()
    assert not wait_gone(TRAIN, 10.0), "elastic workers were left running"


def test_worker_killed_mid_allreduce_job_finishes_from_last_commit(job_factory):
    job = job_factory(HOSTS3, NP3, env={"ELASTIC_KILL_AT": "127.0.0.1:0:7"})
    assert job.finish() == 0, job.output()
    out = job.output()
    result = check_result(job.result, STEPS, [3, 2])
    assert result["size"] == 2 and "127.0.0.1" in out and "blacklist" in out.lower(), out


def test_discovery_adds_a_host_and_the_world_grows(job_factory):
    # the new worker starts (and warms up) while the two train on: 10 s of steps is time
    # enough for it to join on a loaded machine (added at once: no settle time)
    job = job_factory(
        "localhost:2\n",
        ["-np", "2", "--min-np", "2", "--max-np", "3", "--discovery-settle-seconds", "0"],
        env={"ELASTIC_STEP_SLEEP": "0.1"},
        steps=100,
    )
    job.wait_for("TRAIN", count=2)
    job.hosts_file.write_text("localhost:2\n127.0.0.1:1\n")
    assert job.finish() == 0, job.output()
    result = check_result(job.result, 100, [2, 3])
    assert result["size"] == 3


def test_discovery_removes_a_host_and_the_rest_continue(job_factory):
    job = job_factory(HOSTS3, NP3, env={"ELASTIC_STEP_SLEEP": "0.1"}, steps=40)
    job.wait_for("TRAIN", count=3)
    job.hosts_file.write_text("localhost:2\n")
    assert job.finish() == 0, job.output()
    result = check_result(job.result, 40, [3, 2])
    assert result["size"] == 2


def test_a_rank_holding_the_interpreter_lock_for_seconds_costs_no_reset(job_factory):
    """Three 1-slot hosts (the control plane between hosts runs every cycle): one rank's
    background thread cannot run for 2.5 s.  Its peers wait in a collective whose waits are
    taken in slices (to let go when a round changes); none of them may give up or break
    the group (a timed-out Gloo receive would), so the job finishes without a reset."""
    hosts = f"localhost:1\n127.0.0.1:1\n{socket.gethostname()}:1\n"
    job = job_factory(
        hosts,
        ["-np", "3", "--min-np", "2", "--max-np", "3"],
        env={"ELASTIC_HOLD_GIL": "127.0.0.1:0:5:2.5"},
        steps=12,
    )
    assert job.finish(90) == 0, job.output()
    out = job.output()
    assert "HOLDING the GIL for 2.5s at step 5" in out, out
    assert "RESET" not in out and "restoring the last commit" not in out, out
    check_result(job.result, 12, [3])


def test_too_few_slots_for_longer_than_the_elastic_timeout_fails_clearly(job_factory):
    job = job_factory("localhost:1\n", ["-np", "2", "--min-np", "2", "--elastic-timeout", "3"])
    code = job.finish(60)
    assert code != 0 and "--elastic-timeout" in job.output(), job.output()


def test_reset_limit_reached_fails_clearly(job_factory):
    job = job_factory(
        HOSTS3, NP3 + ["--reset-limit", "0"], env={"ELASTIC_KILL_AT": "127.0.0.1:0:3"}
    )
    code = job.finish(60)
    assert code != 0 and "--reset-limit" in job.output(), job.output()


def test_killing_the_launcher_ends_every_worker(job_factory):
    job = job_factory(HOSTS3, NP3, env={"ELASTIC_STEP_SLEEP": "0.2"}, steps=200)
    job.wait_for("TRAIN", count=3)
    assert len(procs_with(TRAIN)) >= 3
    job.proc.send_signal(signal.SIGTERM)
    job.finish(30)
    assert not wait_gone(TRAIN, 15.0), "workers outlived the launcher"


def test_elastic_job_over_ssh(job_factory, sshd):
    job = job_factory(
        "localhost:1\n127.0.0.2:1\n",
        [
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "2",
            *sshd.ssh_args(),
            "--ssh-known-hosts",
            sshd.known_hosts,
            "-x",
            "ELASTIC_KILL_AT",
        ],
        env={"ELASTIC_KILL_AT": "127.0.0.2:0:5"},
    )
    assert job.finish() == 0, job.output()
    check_result(job.result, STEPS, [2, 1])


@pytest.mark.slow  # the same growth with the test's own script: test_discovery_adds_a_host_...
def test_elastic_example_survives_a_new_host(job_factory):
    example = os.path.join(ROOT, "examples", "pytorch_synthetic_benchmark_elastic.py")
    job = job_factory(
        "localhost:1\n",
        ["-np", "1", "--min-np", "1", "--max-np", "2"],
        command=[
            sys.executable,
            example,
            "--batch-size",
            "2",
            "--image-size",
            "16",
            "--width",
            "4",
            "--num-iters",
            "400",
            "--num-batches-per-iter",
            "2",
            "--num-warmup-batches",
            "1",
        ],
    )
    # 400 iterations of ~20 ms: the new worker starts while the first rank trains on, and
    # its round opens once it waits to join (seconds of start-up), long before the end
    job.wait_for("Iter #1:")
    job.hosts_file.write_text("localhost:1\n127.0.0.1:1\n")
    assert job.finish() == 0, job.output()
    out = job.output()
    assert "Reset: now 2 ranks" in out and "Total img/sec on 2 rank(s)" in out, out


def test_one_host_worker_killed_survivors_keep_state_and_finish_fast(job_factory):
    """Every slot on one host: a SIGKILLed worker keeps only its slot out; the two
    survivors go on from their last commit (no restart from step 0, no new process) and
    the job ends within 10 s of the kill."""
    job = job_factory(
        "localhost:3\n",
        ["-np", "3", "--min-np", "2", "--max-np", "3"],
        env={"ELASTIC_KILL_AT": "localhost:1:7"},
    )
    job.wait_for("was killed by signal SIGKILL", timeout_s=90)
    killed_at = time.monotonic()
    assert job.finish() == 0, job.output()
    assert time.monotonic() - killed_at < 10.0, job.output()
    out = job.output()
    check_result(job.result, STEPS, [3, 2])
    assert (
        "blacklisting slot localhost:1 for the rest of the job; the host's other "
        "workers localhost:0, localhost:2 keep running" in out
    ), out
    assert "round 1: 2 workers: rank 0 localhost:0, rank 1 localhost:2" in out, out
    assert "(new)" not in out.split("round 1:")[1], out  # no worker started again
    resumed = [
        int(line.rsplit("step=", 1)[1])
        for line in out.splitlines()
        if "TRAIN rank=" in line and "size=2" in line
    ]
    assert resumed and min(resumed) >= 7, out  # from the last commit


def test_fault_at_fails_a_rank_at_a_commit_and_the_job_recovers(job_factory):
    """``--fault-at``: the process that is rank 1 exits (code 3) right after its fifth
    commit, in the first round only; the script, unchanged, resumes on the two survivors
    from that commit and ends with the fault-free result, every step once."""
    job = job_factory(
        "localhost:3\n",
        [
            "-np",
            "3",
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--fault-at",
            "rank=1,commit=5,exit_code=3,round=0",
        ],
    )
    assert job.finish() == 0, job.output()
    out = job.output()
    assert (
        "hvdlite: injected fault (the fault plan (--fault-at)): rank 1 exit after "
        "commit 5 (round 0)" in out
    ), out
    assert out.count("injected fault") == 1, out
    check_result(job.result, STEPS, [3, 2])


def test_a_stopped_worker_is_ended_and_the_others_go_on(job_factory):
    """A worker SIGSTOPped mid-training: the launcher sees it stopped for 5 s, ends it, and
    the survivors, blocked in a collective with it, go on in the next round from their
    last commit well before --op-timeout-seconds (60 s); the result is the fault-free one
    and the frozen process is gone."""
    import psutil

    job = job_factory(
        "localhost:3\n",
        ["-np", "3", "--min-np", "2", "--max-np", "3"],
        env={"ELASTIC_STEP_SLEEP": "0.1"},
        steps=80,
    )
    job.wait_for("TRAIN rank=2 size=3")
    time.sleep(1.5)
    victim = next(p for p in procs_with(TRAIN) if p.environ().get("HVDLITE_LOCAL_RANK") == "1")
    victim.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    job.wait_for("RESET rank=0 size=2", timeout_s=40)
    resumed = time.monotonic() - frozen_at
    assert job.finish() == 0, job.output()
    out = job.output()
    assert resumed < 20, (resumed, out)
    assert (
        "localhost:1 stopped (SIGSTOP, a debugger or a frozen host) for 5s; ending them" in out
    ), out
    check_result(job.result, 80, [3, 2])
    assert (
        not psutil.pid_exists(victim.pid)
        or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE
    )
