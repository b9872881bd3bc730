"""DistributedOptimizer with hvd.Compression.powersgd / topk at np=2, on Gloo and (when
mpiexec is on PATH) MPI: NumPy references of both algorithms over several steps, error
feedback, checkpoints, backward_passes_per_step with a process set, broadcast_optimizer_state
and elastic state, refusals (workers/grad_compression_worker.py)."""

import pytest

from hvdlite.runner.starters.mpiexec import find_mpiexec

from .conftest import WORKERS, CaseResults, launch

CASES = ["powersgd_matches_reference", "powersgd_backward_passes_and_process_set",
         "topk_matches_reference", "topk_dense_matches_reference",
         "error_feedback_loses_nothing", "checkpoint_round_trip",
         "broadcast_and_elastic_state", "refusals"]


def _run(launcher_args=()):
    rc, out = launch(WORKERS / "grad_compression_worker.py", timeout_s=150,
                     launcher_args=launcher_args)
    return CaseResults(rc, out, np=2)


@pytest.fixture(scope="module")
def gloo():
    return _run()


@pytest.fixture(scope="module")
def mpi():
    if find_mpiexec() is None:
        pytest.skip("no mpiexec on PATH")
    return _run(["--mpi"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_gloo(gloo, case):
    gloo.check(case)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_mpi(mpi, case):
    mpi.check(case)


@pytest.mark.timeout(180)
def test_gloo_exit_code(gloo):
    assert gloo.rc == 0, gloo.output[-6000:]
