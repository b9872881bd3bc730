"""broadcast_* / *_object / SyncBatchNorm at np=2 (workers/functions_worker.py)."""

import pytest

from .conftest import WORKERS, CaseResults, launch

CASES = [
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_lazy_state",
    "broadcast_empty_state_keeps_trajectory", "broadcast_with_scheduler",
    "distributed_optimizer_state", "objects", "sync_batch_norm",
]


@pytest.fixture(scope="module")
def results():
    rc, out = launch(WORKERS / "functions_worker.py", timeout_s=150)
    return CaseResults(rc, out, np=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    results.check(case)


@pytest.mark.timeout(180)
def test_launch_exit_code(results):
    assert results.rc == 0, results.output[-6000:]
