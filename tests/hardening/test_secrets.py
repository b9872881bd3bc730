"""Secrets: every job has a key (MPI too), it leaves the ranks' environment at init(), -x
values never reach mpiexec's command line, objects are never unpickled without a key."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from hvdlite.common import config as cfg

from tests import launching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "hardening", "workers")
BIN = os.path.dirname(sys.executable)
MPIEXEC = shutil.which("mpiexec", path=BIN) or shutil.which("mpiexec")


pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(cfg.PREFIX)}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def _ours():
    """This environment's HVDLITE_* names: a job here starts without them."""
    return [k for k in os.environ if k.startswith(cfg.PREFIX)]


def _launch(flags):
    return launching.run(
        [
            *flags,
            "-np",
            "2",
            "-x",
            "SECRET_X=hunter2",
            sys.executable,
            os.path.join(WORKERS, "secrets_worker.py"),
        ],
        timeout=110,
        unset=_ours(),
        cwd=ROOT,
    )


@pytest.mark.parametrize("flags", [[], ["--mpi", "--verbose"]], ids=["gloo", "mpi"])
def test_key_leaves_the_environment_and_x_values_stay_off_command_lines(flags):
    if flags and MPIEXEC is None:
        pytest.skip("no mpiexec")
    r = _launch(flags)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(
            rf"SECRETS rank={rank} before=True after=False child=False obj=0 "
            rf"x=hunter2",
            r.stdout,
        ), r.stdout
        assert f"REINIT rank={rank} [0, 1]" in r.stdout
    if flags:
        command = [ln for ln in r.stderr.splitlines() if "mpiexec" in ln and "-n" in ln]
        assert command, r.stderr
        assert "hunter2" not in command[0] and cfg.SECRET_KEY + " " not in command[0]
        assert "SECRET_X" in command[0]  # passed by name only


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_plain_mpiexec_without_a_key_refuses_to_unpickle():
    r = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, os.path.join(WORKERS, "plain_object_worker.py")],
        capture_output=True,
        text=True,
        timeout=110,
        env=_env(),
        cwd=ROOT,
    )
    for rank in (0, 1):
        assert f"REFUSED rank={rank} broadcast_object: this job has no secret key" in r.stdout, (
            r.stdout + r.stderr
        )
    assert "UNPICKLED" not in r.stdout


def test_local_job_binds_gloo_listeners_to_loopback():
    from hvdlite.runner.tasks.nics import loopback_interface

    lo = loopback_interface()
    assert lo
    r = launching.run(
        ["-np", "2", sys.executable, os.path.join(WORKERS, "listen_worker.py")],
        timeout=110,
        unset=_ours(),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        assert f"LISTEN rank={rank} iface={lo} ['127.0.0.1']" in r.stdout, r.stdout
