"""The shared-memory path between ranks of one host, through the real launcher: results
against local references with slots small enough that tensors span several, on one host
(np=2, 3) and hierarchically on two hosts x two ranks over a real sshd; a killed rank is
named by its peers, and no segment is ever left in /dev/shm."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from hvdlite.common.backend import shm, shm_leftovers
from tests import launching
from tests.common.conftest import ROOT, WORKERS, assert_ok, run_job

CHECKS = ["allreduce", "scaling", "many_fused", "broadcast_allgather_alltoall"]
SMALL_SLOTS = {"HVDLITE_FUSION_CHUNK_BYTES": "4096", "HVDLITE_INPLACE_THRESHOLD": "0"}
#: two hosts: tensors over 16 KB (a quarter of a slot) cross in pipelined pieces of 16 KB,
#: the MiB-sized ones in 256 pieces (each a Gloo round trip on 2 cores)
HOST_SLOTS = dict(SMALL_SLOTS, HVDLITE_FUSION_CHUNK_BYTES="65536")


def _transports(out):
    return sorted(re.findall(r"SHM rank=(\d+) shm=(\d) hierarchical=(\d)", out))


def _new_segments(before):
    """Segments that appeared since ``before`` and are still there a moment later (a
    concurrent job's segment exists only while its ranks start)."""
    after = set(shm_leftovers.leftover_segments()) - before
    if after:
        time.sleep(2.0)
        after &= set(shm_leftovers.leftover_segments())
    return sorted(after)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "np_, env",
    [(2, SMALL_SLOTS), (3, SMALL_SLOTS), (2, {})],
    ids=["np2-small-slots", "np3-small-slots", "np2-defaults"],
)
def test_one_host(np_, env):
    """Small slots: tensors span several, fused chunks alternate between packing into the
    slot and copying through it; defaults: every fused chunk is packed into the slot."""
    before = set(shm_leftovers.leftover_segments())
    proc = run_job(np_, "shm_worker.py", env=env)
    assert_ok(proc, CHECKS, list(range(np_)))
    assert _transports(proc.stdout) == [(str(r), "1", "0") for r in range(np_)]
    assert _new_segments(before) == []


@pytest.mark.timeout(120)
def test_turned_off_runs_over_gloo():
    proc = run_job(
        2,
        "shm_worker.py",
        "--only",
        "many_fused,scaling",
        env=dict(SMALL_SLOTS, HVDLITE_SHARED_MEMORY="0"),
    )
    assert_ok(proc, ["many_fused", "scaling"], [0, 1])
    assert _transports(proc.stdout) == [("0", "0", "0"), ("1", "0", "0")]


@pytest.mark.timeout(200)
def test_two_hosts_hierarchical(sshd):
    before = set(shm_leftovers.leftover_segments())
    proc = launching.run(
        [
            "-np",
            "4",
            "-H",
            "127.0.0.1:2,127.0.0.2:2",
            *sshd.ssh_args(),
            sys.executable,
            os.path.join(WORKERS, "shm_worker.py"),
        ],
        env={"PYTHONUNBUFFERED": "1", **HOST_SLOTS},
        pythonpath=[ROOT],
        cwd=ROOT,
        timeout=180,
    )
    assert_ok(proc, CHECKS, [0, 1, 2, 3])
    assert _transports(proc.stdout) == [(str(r), "1", "1") for r in range(4)]
    assert _new_segments(before) == []


def _launch_sleeping(np_, tag):
    return launching.start(
        [
            "-np",
            np_,
            sys.executable,
            os.path.join(WORKERS, "shm_worker.py"),
            "--only",
            "many_fused",
            "--sleep",
            "60",
            "--tag",
            tag,
        ],
        env={"PYTHONUNBUFFERED": "1", **SMALL_SLOTS},
        pythonpath=[ROOT],
        cwd=ROOT,
        stderr=subprocess.STDOUT,
    )


def _ranks_of(tag):
    return [p for p in launching.leftovers(tag) if "shm_worker.py" in " ".join(p.info["cmdline"])]


def _wait_for(cond, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(120)
def test_killed_rank_is_named_and_leaves_no_segment():
    before = set(shm_leftovers.leftover_segments())
    tag = uuid.uuid4().hex
    launcher = _launch_sleeping(3, tag)
    try:
        assert _wait_for(lambda: len(_ranks_of(tag)) == 3, 60)
        time.sleep(3.0)  # every rank is in its heartbeat loop
        victim = [p for p in _ranks_of(tag) if "--sleep" in p.cmdline()]
        env_rank = {p.pid: p.environ().get("HVDLITE_LOCAL_RANK") for p in victim}
        doomed = next(p for p in victim if env_rank[p.pid] == "2")
        doomed.send_signal(signal.SIGKILL)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "rank 2 on host localhost was killed by signal SIGKILL" in out, out[-3000:]
    assert _wait_for(lambda: not _ranks_of(tag), 20)
    assert _new_segments(before) == []


@pytest.mark.timeout(120)
def test_killed_launcher_leaves_no_segment():
    before = set(shm_leftovers.leftover_segments())
    tag = uuid.uuid4().hex
    launcher = _launch_sleeping(2, tag)
    try:
        assert _wait_for(lambda: len(_ranks_of(tag)) == 2, 60)
        time.sleep(2.0)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        # the segment's name is gone while the ranks still run: nothing can be left over
        assert _new_segments(before) == []
    finally:
        for p in _ranks_of(tag):
            p.kill()
    assert _wait_for(lambda: not _ranks_of(tag), 20)
    assert _new_segments(before) == []


def _member(ticket, local_rank, ready, die):
    group = shm.SharedMemoryGroup.attach(ticket, local_rank, 2, 4096, [5, 6], timeout_s=30)
    group.barrier()
    ready.set()
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    group.barrier()


def _open_segments():
    """This process's fds that lead to a segment: rank 0's own, until its peers mapped it,
    and one that Python's mmap keeps per mapping."""
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own fd, closed meanwhile
    return [link for link in links if link.startswith(f"/memfd:{shm.MEMFD_NAME}")]


@pytest.mark.timeout(60)
def test_a_dead_local_peer_is_named_within_a_second(tmp_path):
    """The runtime's own detection, without a launcher that ends the job first: a peer
    process dies while this one waits in a barrier."""
    import multiprocessing as mp

    group = shm.SharedMemoryGroup.create(2, 4096, [5, 6], timeout_s=30)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    peer = ctx.Process(target=_member, args=(group.ticket, 1, ready, True))
    peer.start()
    try:
        group.barrier()
        assert ready.wait(10)
        ways_in = len(_open_segments())
        group.unlink()
        assert len(_open_segments()) == ways_in - 1  # rank 0's own fd closed
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            group.barrier()
        assert time.monotonic() - start < 2.0
        assert f"rank 6 (pid {peer.pid}, same host) exited" in str(info.value)
        assert type(info.value).__name__ == "HvdliteInternalError"
    finally:
        peer.join(10)
        group.close()


@pytest.mark.timeout(60)
def test_a_silent_local_peer_times_out_naming_it():
    group = shm.SharedMemoryGroup.create(2, 4096, [3, 8], timeout_s=1.0)
    other = shm.SharedMemoryGroup.attach(group.ticket, 1, 2, 4096, [3, 8], timeout_s=1.0)
    group.unlink()
    try:
        start = time.monotonic()
        with pytest.raises(Exception) as info:  # rank 8 never arrives
            group.barrier()
        assert 0.9 < time.monotonic() - start < 5.0
        assert "ranks [8] (same host) stopped answering" in str(info.value)
    finally:
        other.close()
        group.close()
