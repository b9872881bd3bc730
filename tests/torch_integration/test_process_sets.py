"""Process sets at np=4 on Gloo and MPI (workers/process_sets_worker.py, mpi_comm_worker.py):
two disjoint sets training different models at once, overlapping sets, removal and re-add,
static sets, errors; under MPI also sets made from communicators and init(comm=...)."""

import re
import subprocess
import sys

import pytest

from hvdlite.runner.starters.mpiexec import find_mpiexec
from hvdlite.common.process_sets import ProcessSet

from .conftest import REPO, WORKERS, CaseResults, launch

DYNAMIC_CASES = [
    "collectives",
    "autograd",
    "concurrent_training",
    "objects_and_batchnorm",
    "overlapping",
    "remove_and_readd",
    "collectives_after_readd",
    "mismatch_names_job_ranks",
    "errors",
]
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
    code = (
        "import hvdlite.torch as hvd\n"
        "try:\n    hvd.init(comm=[0])\nexcept ValueError as e:\n    print('REFUSED', e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=50
    )
    assert "REFUSED hvd.init(comm=...) chooses MPI processes" in p.stdout, p.stdout + p.stderr


@pytest.mark.timeout(120)
def test_a_dead_member_fails_its_set_not_the_others():
    rc, out = launch(WORKERS / "process_set_failure_worker.py", np=4, timeout_s=100)
    assert rc == 3, out[-4000:]
    assert "HIGH_OK rank=2 value=7.0" in out and "HIGH_OK rank=3 value=7.0" in out, out[-4000:]
    failed = re.search(r"LOW_FAILED after=([0-9.]+)s error=(.*)", out)
    assert failed, out[-4000:]
    assert float(failed.group(1)) < 30 and "process set" in failed.group(2), failed.group(0)
    assert "rank 1" in out and "exited with code 3" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np", [2, 3])
def test_every_optimizer_class_in_process_sets(np):
    """Horovod's process-set optimizer scenario: each torch.optim class trains in the
    even/odd sets, some raise (Muon when built, LBFGS's zero_grad, SparseAdam), and every
    rank still ends at the final barrier with its set's weights equal.  Then Horovod's own
    case: every rank wraps with the even set, and on the odd ranks it is a local optimizer."""
    rc, out = launch(WORKERS / "process_set_optimizers_worker.py", np=np, timeout_s=100)
    results = CaseResults(rc, out, np=np)
    results.check("optimizers_in_process_sets")
    results.check("optimizer_on_a_non_member")
    assert rc == 0, out[-4000:]
