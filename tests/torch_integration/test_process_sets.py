"""Process sets at np=4 on Gloo and MPI (workers/process_sets_worker.py, mpi_comm_worker.py):
two disjoint sets training different models at once, overlapping sets, removal and re-add,
static sets, errors; under MPI also sets made from communicators and init(comm=...)."""

import subprocess
import sys

import pytest

from hvdlite.runner.mpi_run import find_mpiexec
from hvdlite.common.process_sets import ProcessSet

from .conftest import REPO, WORKERS, CaseResults, launch

DYNAMIC_CASES = ["collectives", "autograd", "concurrent_training", "objects_and_batchnorm",
                 "overlapping", "remove_and_readd", "collectives_after_readd", "errors"]
STATIC_CASES = ["static_collectives", "static_not_dynamic"]
MPI_COMM_CASES = ["set_from_communicator", "init_with_communicator", "init_with_rank_list"]
NO_MPI = find_mpiexec() is None


def _run(script, args=(), launcher_args=()):
    rc, out = launch(WORKERS / script, args, np=4, timeout_s=150, launcher_args=launcher_args)
    return CaseResults(rc, out, np=4)


@pytest.fixture(scope="module")
def gloo_dynamic():
    return _run("process_sets_worker.py", ["dynamic"])


@pytest.fixture(scope="module")
def mpi_dynamic():
    if NO_MPI:
        pytest.skip("no mpiexec on PATH")
    return _run("process_sets_worker.py", ["dynamic"], ["--mpi"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", DYNAMIC_CASES)
def test_gloo(gloo_dynamic, case):
    gloo_dynamic.check(case)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", DYNAMIC_CASES)
def test_mpi(mpi_dynamic, case):
    mpi_dynamic.check(case)


@pytest.mark.timeout(180)
def test_exit_codes(gloo_dynamic, mpi_dynamic):
    assert gloo_dynamic.rc == 0, gloo_dynamic.output[-6000:]
    assert mpi_dynamic.rc == 0, mpi_dynamic.output[-6000:]


@pytest.mark.timeout(180)
def test_static_sets_at_init():
    results = _run("process_sets_worker.py", ["static"])
    for case in STATIC_CASES:
        results.check(case)
    assert results.rc == 0


@pytest.mark.timeout(180)
@pytest.mark.skipif(NO_MPI, reason="no mpiexec on PATH")
def test_mpi_communicators():
    results = _run("mpi_comm_worker.py", launcher_args=["--mpi"])
    for case in MPI_COMM_CASES:
        results.check(case)
    assert results.rc == 0


def test_process_set_before_registration():
    ps = ProcessSet(range(3, -1, -1))
    assert ps.ranks == [0, 1, 2, 3] and ps.process_set_id is None
    assert ps.size() is None and ps.rank() is None and ps.included() is None
    assert "process_set_id=None" in repr(ps)
    with pytest.raises(ValueError, match="repeat"):
        ProcessSet([1, 1])
    with pytest.raises(TypeError, match="list of ranks"):
        ProcessSet("ab")


@pytest.mark.timeout(60)
def test_comm_needs_mpi():
    code = ("import hvdlite.torch as hvd\n"
            "try:\n    hvd.init(comm=[0])\nexcept ValueError as e:\n    print('REFUSED', e)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True,
                       text=True, timeout=50)
    assert "REFUSED hvd.init(comm=...) chooses MPI processes" in p.stdout, p.stdout + p.stderr
