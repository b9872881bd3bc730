"""Helpers for the runtime-core tests: run a worker script as a real job."""

import os
import shutil
import subprocess
import sys

import pytest

from tests import launching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "common", "workers")
BIN = os.path.dirname(sys.executable)


def worker_env(extra=None):
    """This environment for a worker process: the repository importable, no stale rank."""
    return launching.environment({"PYTHONUNBUFFERED": "1", **(extra or {})}, pythonpath=[ROOT])


def run_job(np, script, *args, env=None, timeout=180, launcher="hvdlite"):
    """Run ``script`` on ``np`` ranks through hvdlite-run, mpiexec, or as one plain process."""
    path = os.path.join(WORKERS, script)
    if launcher == "hvdlite":
        return launching.run(
            ["-np", np, sys.executable, path, *args],
            env={"PYTHONUNBUFFERED": "1", **(env or {})},
            timeout=timeout,
            pythonpath=[ROOT],
        )
    elif launcher == "mpiexec":
        mpiexec = shutil.which("mpiexec", path=BIN) or shutil.which("mpiexec")
        if mpiexec is None:
            pytest.fail("mpiexec not found: `pip install mpich` is part of make install")
        cmd = [mpiexec, "-n", str(np), sys.executable, path, *args]
        # plain mpiexec gives no job key (hvdlite-run --mpi does): object collectives
        # refuse to unpickle without one, so give these jobs one the way a user would
        env = {"HVDLITE_SECRET_KEY": os.urandom(32).hex(), **(env or {})}
    else:
        cmd = [sys.executable, path, *args]
    try:
        return subprocess.run(
            cmd, env=worker_env(env), cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"job {script} {args} did not finish within {timeout}s; output so far:\n"
            f"{exc.stdout}\n{exc.stderr}"
        )


def assert_ok(proc, checks, ranks):
    """Every check printed OK on every rank; otherwise show the failing rank's output."""
    out = proc.stdout + proc.stderr
    missing = [f"{c} rank={r}" for c in checks for r in ranks if f"OK {c} rank={r}" not in out]
    assert proc.returncode == 0 and not missing, (
        f"exit code {proc.returncode}; checks without OK: {missing}\n{out[-6000:]}"
    )
