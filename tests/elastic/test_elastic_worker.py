"""The worker side of elastic training with real processes; the test plays the driver.

It serves the rendezvous, publishes each round's slots and starts or kills
workers itself, so these tests pin down what workers do (restore, re-init,
sync, resume) independently of the elastic driver.
"""

import pytest

from hvdlite.common.net.framing import new_key
from hvdlite.runner.store.rendezvous import RendezvousService
from tests.elastic.conftest import Worker, check_result, slots

pytestmark = pytest.mark.timeout(150)

STEPS = 30


@pytest.fixture
def job(tmp_path):
    """``job(places, env)`` serves a rendezvous, publishes round 0 with ``places`` and starts
    their workers; returns ``(key, service, workers)``.  Teardown ends whatever is left."""
    started = []

    def start(places, env):
        key = new_key()
        service = RendezvousService(key, repeat_last=False)
        service.publish(slots(*places))
        workers = {p: Worker(tmp_path, service, key, *p, extra_env=env) for p in places}
        started.append((service, workers))
        return key, service, workers

    yield start
    for service, workers in started:
        for w in workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
        service.shutdown()


def test_a_worker_killed_mid_allreduce_the_survivors_finish_from_the_last_commit(tmp_path, job):
    out = tmp_path / "result.json"
    env = {"ELASTIC_STEPS": str(STEPS), "ELASTIC_OUT": str(out), "ELASTIC_KILL_AT": "hostB:0:7"}
    key, service, workers = job([("hostA", 0), ("hostA", 1), ("hostB", 0)], env)
    victim = workers[("hostB", 0)]
    assert victim.finish() == -9, victim.output()
    service.publish(slots(("hostA", 0), ("hostA", 1)))  # what the driver does
    for p in [("hostA", 0), ("hostA", 1)]:
        assert workers[p].finish() == 0, workers[p].output()
    result = check_result(out, STEPS, [3, 2])
    assert result["sizes"][:7] == [3] * 7 and result["size"] == 2
    assert "RESET rank=0 size=2 step=7" in workers[("hostA", 0)].output()


def test_a_host_added_mid_training_joins_with_the_state_and_no_step_is_lost(tmp_path, job):
    out = tmp_path / "result.json"
    env = {"ELASTIC_STEPS": str(STEPS), "ELASTIC_OUT": str(out), "ELASTIC_STEP_SLEEP": "0.05"}
    key, service, workers = job([("hostA", 0), ("hostA", 1)], env)
    for w in workers.values():
        w.wait_for("TRAIN")
    service.publish(slots(("hostA", 0), ("hostA", 1), ("hostB", 0)))
    workers[("hostB", 0)] = Worker(tmp_path, service, key, "hostB", 0, extra_env=env)
    for w in workers.values():
        assert w.finish() == 0, w.output()
    result = check_result(out, STEPS, [2, 3])
    assert result["size"] == 3
    assert "DONE rank=2 size=3 steps=30" in workers[("hostB", 0)].output()


def test_a_removed_host_leaves_cleanly_and_the_rest_continue(tmp_path, job):
    out = tmp_path / "result.json"
    env = {"ELASTIC_STEPS": str(STEPS), "ELASTIC_OUT": str(out), "ELASTIC_STEP_SLEEP": "0.05"}
    key, service, workers = job([("hostA", 0), ("hostB", 0), ("hostB", 1)], env)
    for w in workers.values():
        w.wait_for("TRAIN")
    service.publish(slots(("hostA", 0), ("hostB", 0)))
    leaver = workers[("hostB", 1)]
    assert leaver.finish() == 0, leaver.output()
    assert "has no place for host hostB local slot 1" in leaver.output()
    for p in [("hostA", 0), ("hostB", 0)]:
        assert workers[p].finish() == 0, workers[p].output()
    check_result(out, STEPS, [3, 2])
