"""No process left behind: SIGKILL the launcher of silent ranks, in every launch mode, and
check that no rank survives it by more than 10 s."""

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests import launching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SILENT = os.path.join(ROOT, "tests", "hardening", "workers", "silent.py")
BIN = os.path.dirname(sys.executable)


def _with_token(token, exclude=()):
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.pid in exclude or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(token in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _kill_launcher_and_count_survivors(flags, n_ranks, rank_marker=SILENT):
    """Start ``hvdlite-run FLAGS python silent.py TOKEN``, wait for its ranks, SIGKILL it;
    returns the processes with the token still alive 10 s later."""
    token = uuid.uuid4().hex
    launcher = launching.start(
        [*flags, sys.executable, SILENT, token, "300"],
        stdout=subprocess.DEVNULL,
        text=False,
        cwd=ROOT,
    )
    survivors = []
    try:
        deadline = time.monotonic() + 40
        ranks = []
        while time.monotonic() < deadline:
            ranks = [
                p
                for p in _with_token(token, {launcher.pid})
                if os.path.basename(p.cmdline()[1] if len(p.cmdline()) > 1 else "")
                == os.path.basename(rank_marker)
            ]
            if len(ranks) >= n_ranks or launcher.poll() is not None:
                break
            time.sleep(0.1)
        assert len(ranks) == n_ranks, (
            launcher.poll(),
            launcher.stderr.read().decode() if launcher.poll() is not None else "",
        )
        time.sleep(0.5)  # settled: silent and running
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            survivors = _with_token(token, {launcher.pid})
            if not survivors:
                break
            time.sleep(0.1)
        return survivors
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in _with_token(token, {launcher.pid}):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.mark.timeout(60)
def test_sigkill_of_local_launcher_leaves_no_rank():
    left = _kill_launcher_and_count_survivors(["-np", "2"], 2)
    assert left == [], [p.cmdline() for p in left]


@pytest.mark.timeout(60)
def test_sigkill_of_mpi_launcher_leaves_no_rank():
    if not (os.path.exists(os.path.join(BIN, "mpiexec")) or __import__("shutil").which("mpiexec")):
        pytest.skip("no mpiexec")
    left = _kill_launcher_and_count_survivors(["--mpi", "-np", "2"], 2)
    assert left == [], [p.cmdline() for p in left]


@pytest.mark.timeout(90)
def test_sigkill_of_ssh_launcher_leaves_no_task_or_rank(sshd):
    left = _kill_launcher_and_count_survivors(
        ["-np", "3", "-H", "127.0.0.1:1,127.0.0.2:2", *sshd.ssh_args()], 3
    )
    assert left == [], [p.cmdline() for p in left]
