"""hvd.DiLoCo and hvd.Compression.int8 at np=2 (every case) and np=3 (DiLoCo's ranks agree
after each outer step; H = 1 is synchronous SGD; int8 within its bound), on Gloo
(workers/slow_links_worker.py)."""

import pytest

from .conftest import WORKERS, CaseResults, launch, worker_suite

CASES = [
    "h1_equals_synchronous_sgd",
    "ranks_agree_after_each_outer_step",
    "outer_step_is_nesterov_on_the_average",
    "checkpoint_round_trip",
    "elastic_state_keeps_the_outer_state",
    "refusals",
    "int8_within_its_bound",
    "int8_error_feedback_is_unbiased_over_steps",
    "diloco_with_an_int8_outer_exchange",
    "streaming_fragments_sync_in_turn",
    "overlap_applies_the_average_one_step_late",
]
NP3_CASES = [
    "h1_equals_synchronous_sgd",
    "ranks_agree_after_each_outer_step",
    "int8_within_its_bound",
]

results, test_case, test_launch_exit_code = worker_suite("slow_links_worker.py", CASES)


@pytest.fixture(scope="module")
def np3():
    rc, out = launch(WORKERS / "slow_links_worker.py", args=NP3_CASES, np=3, timeout_s=150)
    return CaseResults(rc, out, np=3)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", NP3_CASES)
def test_np3(np3, case):
    np3.check(case)
