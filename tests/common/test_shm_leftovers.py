"""No shared-memory segment outlives its job: SIGKILL of the launcher or of a rank right
after the host's segment was made (the worker stops there on purpose) or at a random later
moment; leftovers of dead jobs (older versions named their segments in /dev/shm) are removed
by the next job, and never a segment whose owner lives."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from hvdlite.common.backend import shm
from tests.common.conftest import ROOT, WORKERS, worker_env


class _Job:
    """A 2-rank job of ``shm_worker.py`` whose output is read as it comes."""

    def __init__(self, *args):
        self.tag = uuid.uuid4().hex
        cmd = [sys.executable, "-m", "hvdlite.runner.launch", "-np", "2", sys.executable,
               os.path.join(WORKERS, "shm_worker.py"), "--only", "many_fused", "--tag",
               self.tag, *args]
        self.proc = subprocess.Popen(cmd, env=worker_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def output(self):
        return "".join(self.lines)

    def wait_for_line(self, text, timeout_s):
        return _wait_for(lambda: any(text in line for line in self.lines), timeout_s)

    def ranks(self):
        """The job's rank processes by local rank."""
        found = {}
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if self.tag in cmd and "hvdlite.runner.launch" not in cmd:
                try:
                    found[int(p.environ()["HVDLITE_LOCAL_RANK"])] = p
                except (psutil.Error, KeyError):
                    continue
        return found

    def end(self):
        if self.proc.poll() is None:
            self.proc.kill()
        for p in self.ranks().values():
            p.kill()
        self.proc.wait(10)
        self._reader.join(10)


def _wait_for(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _segments_of(pids):
    """The named segments in /dev/shm that one of ``pids`` owned."""
    owned = []
    for name in shm.leftover_segments():
        try:
            if set(shm.segment_owners(name)) & set(pids):
                owned.append(name)
        except OSError:
            continue                      # another job's segment went meanwhile
    return owned


def _kill_and_check(job, victim, pids):
    """SIGKILL ``victim`` ("launcher" or a local rank); then every process of the job ends
    and no segment of the job is left."""
    target = job.proc.pid if victim == "launcher" else pids[victim]
    os.kill(target, signal.SIGKILL)
    if victim != "launcher":
        job.proc.wait(60)                 # the launcher ends the job
    assert _wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() !=
                                     psutil.STATUS_ZOMBIE for p in pids.values()), 30), \
        job.output()[-3000:]
    assert _segments_of(pids.values()) == [], job.output()[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["launcher", 0, 1])
def test_kill_at_the_creation_moment_leaves_no_segment(victim):
    job = _Job("--pause-after-create", "60")
    try:
        assert job.wait_for_line("SEGMENT_CREATED", 90), job.output()[-3000:]
        pids = {r: p.pid for r, p in job.ranks().items()}
        assert sorted(pids) == [0, 1], job.output()[-3000:]
        _kill_and_check(job, victim, pids)
    finally:
        job.end()


@pytest.mark.timeout(120)
def test_kill_at_a_random_later_moment_leaves_no_segment():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    victim, delay = rng.choice(["launcher", 0, 1]), rng.uniform(0.0, 3.0)
    job = _Job("--sleep", "30")
    try:
        assert _wait_for(lambda: len(job.ranks()) == 2, 90), job.output()[-3000:]
        pids = {r: p.pid for r, p in job.ranks().items()}
        time.sleep(delay)
        _kill_and_check(job, victim, pids)
    finally:
        job.end()
