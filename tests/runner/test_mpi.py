"""MPI mode: the mpiexec command per flavour, and a real run under MPICH's Hydra."""

import re

import pytest

from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.mpi_run import (HYDRA, INTEL, OPENMPI, build_command, detect_flavor,
                                    find_mpiexec)

from conftest import run_launcher, worker

pytestmark = pytest.mark.timeout(90)
HOSTS = [HostSlots("a", 2), HostSlots("b", 1)]


def test_hydra_command():
    cmd = build_command(HYDRA, "mpiexec", 3, HOSTS, {"HVDLITE_CPU_OPERATIONS": "mpi"},
                        ["PATH", "FOO"], ["-verbose"], ["python", "t.py"], ssh_port=2222)
    assert cmd[:6] == ["mpiexec", "-n", "3", "-hosts", "a:2,b:1", "-prepend-rank"]
    assert ["-genv", "HVDLITE_CPU_OPERATIONS", "mpi"] == cmd[cmd.index("-genv"):][:3]
    assert cmd[cmd.index("-envlist") + 1] == "PATH,FOO"
    assert cmd[cmd.index("-launcher-exec") + 1] == "ssh -p 2222"
    assert cmd[-3:] == ["-verbose", "python", "t.py"]


def test_openmpi_command():
    cmd = build_command(OPENMPI, "mpirun", 3, HOSTS, {"K": "v"}, ["FOO"], [], ["t"])
    assert cmd[:6] == ["mpirun", "--allow-run-as-root", "-np", "3", "-H", "a:2,b:1"]
    assert "--tag-output" in cmd and ["-x", "K=v"] == cmd[cmd.index("-x"):][:2]
    assert cmd[-3:] == ["-x", "FOO", "t"]


def test_intel_command():
    cmd = build_command(INTEL, "mpiexec", 1, HOSTS[:1], {}, ["FOO"], [], ["t"])
    assert "-genvlist" in cmd and "-envlist" not in cmd


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_detects_installed_mpich():
    assert detect_flavor(find_mpiexec()) == HYDRA


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_mode_end_to_end():
    r = run_launcher(["--mpi", "-np", "2", "--cycle-time-ms", "2", "-x", "MPI_X_VAR=7",
                      worker("mpi_worker.py")])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(re.findall(r"MPIOK .*", r.stdout))
    assert lines == [f"MPIOK rank={i} size=2 sum=3 cycle=2.0 x=7" for i in range(2)]


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_mode_failure_exit_code():
    r = run_launcher(["--mpi", "-np", "2", worker("mpi_worker.py"), "1"])
    assert r.returncode != 0
    assert "mpiexec" in r.stderr


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_mode_runtime_smoke():
    try:
        import hvdlite.torch  # noqa: F401
    except Exception:
        pytest.skip("hvdlite.torch runtime not available")
    r = run_launcher(["--mpi", "-np", "2", worker("torch_worker.py")], timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(re.findall(r"TRAINOK rank=\d size=2", r.stdout)) == 2
