"""Corners of horovod.torch's behaviour (workers/horovod_parity_worker.py), at np=2 and np=3
(join's last rank, process sets of one and two ranks and turn-taking need a third rank)."""

import pytest

from .conftest import WORKERS, CaseResults, launch

CASES = [
    "optimizer_on_sets",
    "sparse_in_sets",
    "join_refuses_allgather_broadcast",
    "duplicate_names_are_value_errors",
    "reducescatter_adasum",
    "generated_parameter_names",
    "sparse_adam_buckets",
    "sparse_adam_allgather",
    "sparse_adam_as_dense",
    "sync_then_step_warns",
    "uint16_everywhere",
]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def results(request):
    rc, out = launch(WORKERS / "horovod_parity_worker.py", np=request.param, timeout_s=150)
    return CaseResults(rc, out, np=request.param)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    results.check(case)


@pytest.mark.timeout(180)
def test_launch_exit_code(results):
    assert results.rc == 0, results.output[-6000:]
