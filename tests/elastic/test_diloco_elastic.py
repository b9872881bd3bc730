"""hvd.DiLoCo in an elastic job: a worker killed during inner steps (no collective runs
then) is replaced, and the job goes on from the last outer commit; with the world back at
its size, the weights equal a failure-free DiLoCo run, every outer step committed once."""

import json
import socket

import pytest

from tests.elastic.test_elastic_launch import job_factory  # noqa: F401 (fixture)
from tests.elastic.conftest import elastic_train

pytestmark = pytest.mark.timeout(180)

H, STEPS = 3, 12


def test_a_worker_killed_during_inner_steps_costs_no_outer_step(job_factory):  # noqa: F811
    hosts = f"localhost:1\n127.0.0.1:1\n{socket.gethostname()}:1\n"
    job = job_factory(
        hosts,
        ["-np", "2", "--min-np", "2", "--max-np", "2"],
        # rank 1 dies in step 7: after outer step 2's commit (steps 0-5), inside the inner
        # steps 6-8 of outer step 3
        env={"ELASTIC_DILOCO": str(H), "ELASTIC_KILL_AT": "127.0.0.1:0:7"},
        steps=STEPS,
    )
    assert job.finish() == 0, job.output()
    out = job.output()
    assert "RESET" in out, out
    with open(job.result) as f:
        result = json.load(f)
    assert result["history"] == list(range(STEPS)), result["history"]
    assert result["outer"] == list(range(1, STEPS // H + 1)), result["outer"]
    assert result["sizes"] == [2] * STEPS and result["size"] == 2, result
    weight, bias = elastic_train.diloco_reference(STEPS, H, 2)
    got = result["weight"] + result["bias"]
    assert all(abs(a - b) < 1e-5 for a, b in zip(got, weight + bias)), (got, weight + bias)
