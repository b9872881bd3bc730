"""Elastic jobs go on without a rank that is alive but not progressing.

Three slots on one host (``--min-np 2``); one worker of the round stops progressing
at step 5 without exiting: it holds the interpreter lock in a C call (none of its
threads runs, its process stays), or it deadlocks in its own code (its threads run,
it never submits).  Its peers give up on it (the op timeout, or the stall shutdown),
the launcher confirms it is stuck, ends it, and the two others train on from the last
commit: every step once, the same weights as one process, the stuck process gone.
"""

import os
import time

import pytest

from tests.elastic.conftest import WORKERS, check_result
from tests.elastic.test_elastic_launch import Job
from tests.runner.conftest import wait_gone

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TRAIN = os.path.join(WORKERS, "elastic_train.py")
STEPS = 20
OP_TIMEOUT_S = 10
FLAGS = ["-np", "3", "--min-np", "2", "--max-np", "3"]


@pytest.fixture
def job(tmp_path):
    made = []

    def make(flags, env):
        made.append(Job(tmp_path, "localhost:3\n", flags, env=env, steps=STEPS))
        return made[-1]

    yield make
    for j in made:
        j.kill()
    assert not wait_gone(TRAIN, 10.0), "elastic workers were left running"


def _seconds_until(j, text, timeout_s):
    start = time.monotonic()
    j.wait_for(text, timeout_s=timeout_s)
    return time.monotonic() - start


def test_a_rank_holding_the_interpreter_lock_is_ended_and_the_others_go_on(job):
    j = job(
        FLAGS + ["--op-timeout-seconds", str(OP_TIMEOUT_S)],
        {"ELASTIC_HOLD_GIL": "localhost:2:5:90", "ELASTIC_STEP_SLEEP": "0.05"},
    )
    j.wait_for("HOLDING the GIL for 90s at step 5", timeout_s=90)
    took = _seconds_until(j, "RESET rank=0 size=2 step=5", OP_TIMEOUT_S + 25)
    assert j.finish(90) == 0, j.output()
    out = j.output()
    assert "rank 2 on host localhost has not answered for" in out, out
    assert "ending worker localhost:2 so that the others go on without it" in out, out
    result = check_result(j.result, STEPS, [3, 2])
    assert result["size"] == 2
    assert took <= OP_TIMEOUT_S + 25, took


def test_a_deadlocked_rank_is_left_out_after_the_stall_shutdown(job):
    j = job(
        FLAGS
        + ["--stall-check-warning-time-seconds", "2", "--stall-check-shutdown-time-seconds", "5"],
        {"ELASTIC_DEADLOCK": "localhost:2:5", "ELASTIC_STEP_SLEEP": "0.05"},
    )
    j.wait_for("DEADLOCKED at step 5", timeout_s=90)
    took = _seconds_until(j, "RESET rank=0 size=2 step=5", 40)
    assert j.finish(90) == 0, j.output()
    out = j.output()
    assert "rank 2 on host localhost never submitted tensor" in out, out
    check_result(j.result, STEPS, [3, 2])
    assert took <= 5 + 20, took
