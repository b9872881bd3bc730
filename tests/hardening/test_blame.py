"""The launcher names the rank that left or went silent, not the rank that noticed."""

import importlib.util
import os
import sys

import pytest

from hvdlite.runner.starters.mpiexec import find_mpiexec

from tests import launching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEAVE = os.path.join(ROOT, "tests", "hardening", "workers", "leave_worker.py")


pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]


def _run(mode, hosts=()):
    r = launching.run(
        ["-np", "2", *hosts, "--op-timeout-seconds", "3", sys.executable, LEAVE, mode],
        timeout=80,
        cwd=ROOT,
    )
    last = [ln for ln in r.stderr.splitlines() if ln.startswith("hvdlite-run:")]
    return r.returncode, last[-1] if last else r.stderr


def test_rank_that_exits_0_early_is_named():
    code, line = _run("exit0")
    assert code != 0
    assert line.startswith("hvdlite-run: rank 1 on host "), line
    assert "exited with code 0 before its peers finished" in line
    assert "rank 0 on host" in line and "then failed" in line


def test_stopped_rank_is_named_with_what_was_seen():
    code, line = _run("stop")
    assert code != 0
    assert line.startswith("hvdlite-run: rank 1 on host "), line
    assert "stopped answering for 3s (--op-timeout-seconds)" in line
    assert "its process is stopped" in line and "rank 0 on host" in line


def test_rank_that_raised_is_named_with_its_exception():
    """Rank 0 fails too (its collective failed because rank 1 left) and may exit first,
    but the summary names rank 1 with its own exception, which only rank 1's exit report
    carries."""
    code, line = _run("raise")
    assert code == 1
    assert line.startswith("hvdlite-run: rank 1 on host localhost "), line
    assert "ValueError: bad batch 17 on rank one; " in line, line
    assert "HvdliteInternalError" not in line, line


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH (pip install mpich)")
def test_rank_that_raised_under_mpi_is_named():
    """Under --mpi, too, the launcher names the rank that raised, from its exit report to
    the launcher's report store, not only mpiexec's exit code."""
    code, line = _run("raise", ["--mpi"])
    assert code != 0
    assert line.startswith("hvdlite-run: rank 1 on host "), line
    assert "ValueError: bad batch 17 on rank one; mpiexec (" in line, line
    assert "HvdliteInternalError" not in line, line


def test_rank_that_raised_on_a_remote_host_is_named(sshd):
    code, line = _run("raise", ["-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args()])
    assert code == 1
    assert line.startswith("hvdlite-run: rank 1 on host 127.0.0.2 "), line
    assert "ValueError: bad batch 17 on rank one; " in line, line


@pytest.mark.parametrize(
    "mode, seen",
    [
        ("stop", "stopped answering for 3s (--op-timeout-seconds): its process is stopped"),
        ("exit0", "exited with code 0 before its peers finished"),
    ],
)
def test_remote_rank_that_left_or_stopped_is_named(sshd, mode, seen):
    code, line = _run(mode, ["-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args()])
    assert code != 0
    assert line.startswith("hvdlite-run: rank 1 on host 127.0.0.2 "), line
    assert seen in line and "rank 0 on host 127.0.0.1 then failed" in line


def test_over_long_name_is_refused_and_the_runtime_keeps_working():
    worker = os.path.join(ROOT, "tests", "hardening", "workers", "long_name_worker.py")
    r = launching.run(["-np", "2", sys.executable, worker], timeout=80, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:REFUSED" in r.stdout and "limited to 4096" in r.stdout
        assert f"[{rank}]<stdout>:SUM 2" in r.stdout
    assert "ACCEPTED" not in r.stdout
