"""DistributedOptimizer at np=2 equals one process on the full batch (workers/optimizer_worker.py)."""

import pytest

from .conftest import WORKERS, CaseResults, launch

CASES = [
    "sgd_momentum", "adam", "adamw_params_path", "sgd_tiny_buckets", "sgd_bpps2",
    "adam_bpps2_params_path", "sgd_fp16", "adam_fp16_params_path", "sgd_op_sum",
    "sgd_op_sum_predivide", "sgd_average_predivide", "sgd_num_groups", "adam_explicit_groups",
    "sparse_params_path", "sparse_as_dense", "sparse_buckets", "custom_subclass",
    "uneven_usage", "errors", "sync_then_step", "set_to_none_by_module", "lr_scheduler",
]


@pytest.fixture(scope="module")
def results():
    rc, out = launch(WORKERS / "optimizer_worker.py", timeout_s=150)
    return CaseResults(rc, out, np=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    results.check(case)


@pytest.mark.timeout(180)
def test_launch_exit_code(results):
    assert results.rc == 0, results.output[-6000:]
