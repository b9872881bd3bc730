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

from hvdlite.common.backend import shm, shm_leftovers
from tests import launching
from tests.common.conftest import ROOT, WORKERS, assert_ok, run_job


class _Job:
    """A 2-rank job of ``shm_worker.py`` whose output is read as it comes."""

    def __init__(self, *args):
        self.tag = uuid.uuid4().hex
        self.proc = launching.start(
            [
                "-np",
                "2",
                sys.executable,
                os.path.join(WORKERS, "shm_worker.py"),
                "--only",
                "many_fused",
                "--tag",
                self.tag,
                *args,
            ],
            env={"PYTHONUNBUFFERED": "1"},
            pythonpath=[ROOT],
            cwd=ROOT,
            stderr=subprocess.STDOUT,
        )
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
        for p in launching.leftovers(self.tag):
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


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _segments_of(pids):
    """The named segments in /dev/shm that one of ``pids`` owned."""
    owned = []
    for name in shm_leftovers.leftover_segments():
        try:
            if set(shm_leftovers.segment_owners(name)) & set(pids):
                owned.append(name)
        except OSError:
            continue  # another job's segment went meanwhile
    return owned


def _kill_and_check(job, victim, pids):
    """SIGKILL ``victim`` ("launcher" or a local rank); then every process of the job ends
    and no segment of the job is left."""
    target = job.proc.pid if victim == "launcher" else pids[victim]
    os.kill(target, signal.SIGKILL)
    if victim != "launcher":
        job.proc.wait(60)  # the launcher ends the job
    assert _wait_for(lambda: not any(_alive(p) for p in pids.values()), 30), job.output()[-3000:]
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


def _own_named_segment(path, ready, hold):
    """A process that owns a named segment (as earlier versions made them), then dies by
    SIGKILL at once or holds it until ``hold`` is set."""
    shm.SharedMemoryGroup.create(2, 4096, [0, 1], 30.0, path=path)
    ready.set()
    if hold is None:
        os.kill(os.getpid(), signal.SIGKILL)
    hold.wait(60)


def _named_segments(*holds):
    """Named segments in /dev/shm: one whose owner was killed and one per ``holds`` whose
    owner lives until its event is set."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    made = []
    for hold in (None, *holds):
        path = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}test-{uuid.uuid4().hex}")
        ready = ctx.Event()
        owner = ctx.Process(target=_own_named_segment, args=(path, ready, hold))
        owner.start()
        assert ready.wait(30)
        made.append((path, owner))
    made[0][1].join(10)
    assert made[0][1].exitcode == -signal.SIGKILL
    return made


@pytest.mark.timeout(60)
def test_only_segments_whose_owners_are_all_dead_are_removed():
    import multiprocessing as mp

    hold = mp.get_context("fork").Event()
    (dead, _), (live, owner) = _named_segments(hold)
    ownerless = os.path.join(shm.SHM_DIR, f"{shm.PREFIX}test-{uuid.uuid4().hex}")
    with open(ownerless, "wb") as f:  # made this instant: its maker writes its pid next
        f.truncate(8192)  # (numbers no pid can be count as none)
        f.seek(64 * 8)
        f.write((1 << 40).to_bytes(8, "little") + (-5).to_bytes(8, "little", signed=True))
    try:
        assert shm_leftovers.segment_owners(os.path.basename(dead)) != []
        removed = shm_leftovers.remove_dead_segments()
        assert os.path.basename(dead) in removed and not os.path.exists(dead)
        assert os.path.exists(live) and os.path.exists(ownerless)
        assert os.path.basename(ownerless) in shm_leftovers.remove_dead_segments(grace_s=0.0)
        assert os.path.exists(live)
        hold.set()
        owner.join(10)
        assert os.path.basename(live) in shm_leftovers.remove_dead_segments()
    finally:
        hold.set()
        for path in (dead, live, ownerless):
            if os.path.exists(path):
                os.unlink(path)


def test_what_a_ticket_names_is_mapped_only_when_it_is_that_segment(tmp_path):
    """A rank handed a ticket whose pid or fd now leads elsewhere maps nothing and writes
    nothing: the size, then the tag, must be the segment's."""
    group = shm.SharedMemoryGroup.create(2, 4096, [0, 1], 30.0)
    try:
        address, tag = group.ticket.split(" ")
        other_tag = f"{address} {'0' * len(tag)}"
        with pytest.raises(Exception, match="not this job's shared-memory segment") as info:
            shm.SharedMemoryGroup.attach(other_tag, 1, 2, 4096, [0, 1], 30.0)
        assert type(info.value).__name__ == "HvdliteInternalError"
        assert group._pids[1] == 0
        stranger = tmp_path / "stranger"
        stranger.write_bytes(b"x" * 100)
        with pytest.raises(Exception, match="holds 100 bytes"):
            shm.SharedMemoryGroup.attach(f"{stranger} {tag}", 1, 2, 4096, [0, 1], 30.0)
        assert stranger.read_bytes() == b"x" * 100
        peer = shm.SharedMemoryGroup.attach(group.ticket, 1, 2, 4096, [0, 1], 30.0)
        assert group._pids[1] == os.getpid()
        peer.close()
    finally:
        group.close()


def test_a_recycled_pid_does_not_keep_a_segment():
    """A live process that started after the segment last changed is not its owner."""
    me = os.getpid()
    assert shm_leftovers._started_before(me, time.time())
    assert not shm_leftovers._started_before(me, psutil.Process(me).create_time() - 5.0)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert not shm_leftovers._started_before(int(dead.stdout), time.time())


@pytest.mark.timeout(120)
def test_the_next_job_removes_a_dead_jobs_segment_and_keeps_a_live_ones():
    import multiprocessing as mp

    hold = mp.get_context("fork").Event()
    (dead, _), (live, owner) = _named_segments(hold)
    try:
        proc = run_job(2, "shm_worker.py", "--only", "broadcast_allgather_alltoall")
        assert_ok(proc, ["broadcast_allgather_alltoall"], [0, 1])
        assert not os.path.exists(dead), proc.stdout[-2000:] + proc.stderr[-2000:]
        assert os.path.exists(live)
    finally:
        hold.set()
        owner.join(10)
        for path in (dead, live):
            if os.path.exists(path):
                os.unlink(path)
