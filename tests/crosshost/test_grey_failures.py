"""Grey failures across three namespaced hosts (tests/testbed): a rank that holds its
interpreter lock, a partial partition (two hosts that cannot reach each other while both
reach the launcher's), a one-way drop, and a paused task service whose ranks are healthy.
The launcher runs on tbh0; every host has its own task service over SSH."""

import os
import re
import signal
import time

import pytest

from tests import testbed

from .conftest import REPO, Job, cmdline, leftovers

RUNNER_WORKERS = os.path.join(REPO, "tests", "runner", "workers")
ELASTIC_WORKERS = os.path.join(REPO, "tests", "elastic", "workers")
THREE = ["-np", "3", "-H", "tbh0:1,tbh1:1,tbh2:1"]
OP_TIMEOUT_S = 20
HOSTS = ("tbh0", "tbh1", "tbh2")


@pytest.fixture(scope="module")
def testbed3():
    try:
        tb = testbed.Testbed(3)
    except testbed.TestbedUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield tb
    finally:
        tb.close()


def _no_leftovers(tb, within_s=25.0):
    deadline = time.monotonic() + within_s
    while any(leftovers(tb, h) for h in HOSTS) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(leftovers(tb, h) == [] for h in HOSTS), {h: leftovers(tb, h) for h in HOSTS}


def _last_line(text):
    return [line for line in text.splitlines() if line.startswith("hvdlite-run:")][-1]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_rank_holding_its_interpreter_lock_is_named_with_host_pid_and_stack(testbed3):
    """Rank 1 on tbh1 sleeps in a C call that keeps the interpreter lock: its task
    service and process look fine, but no thread of it runs.  The launcher names it
    within seconds, with the stack py-spy took on tbh1, and the summary blames it, not
    rank 0 whose collective timed out."""
    job = Job(
        testbed3,
        "tbh0",
        THREE + ["--op-timeout-seconds", str(OP_TIMEOUT_S)],
        os.path.join(RUNNER_WORKERS, "wedge_worker.py"),
        ["1", "60"],
    )
    wedged_at = job.wait_for("WEDGED rank=1", 90)
    named_at = job.wait_for("has not answered for", 30)
    rc = job.finish(OP_TIMEOUT_S + 40)
    ended = time.monotonic()
    text = job.text()
    assert rc != 0, text
    pid = re.search(r"WEDGED rank=1 pid=(\d+)", text).group(1)
    assert re.search(rf"rank 1 on host tbh1 \(pid {pid}\) has not answered for \d+s", text), text
    assert "hold_the_interpreter_lock" in text.split("has not answered for")[1], text
    assert named_at - wedged_at < 15, (named_at - wedged_at, text)
    last = _last_line(text)
    assert last.startswith(f"hvdlite-run: rank 1 on host tbh1 stopped answering (pid {pid})"), last
    assert "ranks 0, 2 only waited for it" in last, last
    assert ended - wedged_at < OP_TIMEOUT_S + 15, (ended - wedged_at, text)
    _no_leftovers(testbed3)
    print(
        f"MEASURED static GIL: named {named_at - wedged_at:.1f}s, ended "
        f"{ended - wedged_at:.1f}s after the wedge; summary: {last}"
    )


def _partitioned_static_job(tb, both_ways):
    job = Job(
        tb,
        "tbh0",
        THREE + ["--op-timeout-seconds", str(OP_TIMEOUT_S)],
        "allreduce_steps.py",
        ["100000", "4096"],
    )
    try:
        job.wait_for("STEP 30 rank=2", 90)
        cut_at = time.monotonic()
        tb.drop_between("tbh1", "tbh2", both_ways=both_ways)
        rc = job.finish(OP_TIMEOUT_S + 40)
        took = time.monotonic() - cut_at
    finally:
        tb.undrop("tbh1", "tbh2")
    return rc, took, job.text()


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("both_ways", [True, False], ids=["both-ways", "one-way"])
def test_a_static_job_cut_between_two_hosts_names_the_link(testbed3, both_ways):
    """tbh1 and tbh2 cannot exchange (both ways, or tbh1 -> tbh2 only) while both reach
    tbh0: the job ends within the op timeout naming the link, never tbh0."""
    rc, took, text = _partitioned_static_job(testbed3, both_ways)
    assert rc != 0, text
    last = _last_line(text)
    assert (
        "hosts tbh1 and tbh2 cannot reach each other (rank 1 and rank 2 could not "
        "exchange), while both reach the launcher" in last
    ), last
    assert took < OP_TIMEOUT_S + 20, (took, text)
    assert "rank 0 on host tbh0 exited" not in last, last
    _no_leftovers(testbed3)
    print(
        f"MEASURED static cut ({'both ways' if both_ways else 'one way'}): ended "
        f"{took:.1f}s after the cut; summary: {last}"
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_paused_task_service_with_healthy_ranks_does_not_end_a_static_job(testbed3):
    job = Job(testbed3, "tbh0", THREE, "allreduce_steps.py", ["4000", "4096"])
    job.wait_for("STEP 10 rank=1", 90)
    (task,) = [
        pid for pid in testbed3.pids("tbh1") if "hvdlite.runner.tasks.task_service" in cmdline(pid)
    ]
    os.kill(task, signal.SIGSTOP)
    try:
        job.wait_for("the task service on host tbh1 has not replied", 30)
        time.sleep(4)
    finally:
        os.kill(task, signal.SIGCONT)
    rc = job.finish(120)
    text = job.text()
    assert rc == 0, text
    assert len(re.findall(r"SUMS_OK rank=\d", text)) == 3, text
    assert "stopped answering" not in text, text
    _no_leftovers(testbed3)
    print("MEASURED paused task service: the job finished (rc 0)")


def _elastic_job(tb, tmp_path, flags, env, steps):
    """An elastic job over the three 1-slot hosts (min 2), training
    tests/elastic/workers/elastic_train.py, slow while ``tmp_path/slow`` exists."""
    slow = tmp_path / "slow"
    slow.write_text("")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("tbh0:1\ntbh1:1\ntbh2:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    names = ["ELASTIC_STEPS", "ELASTIC_STEP_SLEEP", "ELASTIC_SLEEP_WHILE", "ELASTIC_OUT"]
    env = dict(
        {
            "ELASTIC_STEPS": str(steps),
            "ELASTIC_STEP_SLEEP": "0.2",
            "ELASTIC_SLEEP_WHILE": str(slow),
            "ELASTIC_OUT": str(tmp_path / "result.json"),
        },
        **env,
    )
    forwarded = [arg for name in names + sorted(set(env) - set(names)) for arg in ("-x", name)]
    job = Job(
        tb,
        "tbh0",
        [
            "-np",
            "3",
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--host-discovery-script",
            str(discover),
            "--op-timeout-seconds",
            str(OP_TIMEOUT_S),
            *flags,
            *forwarded,
        ],
        os.path.join(ELASTIC_WORKERS, "elastic_train.py"),
        env=env,
    )
    return job, slow, tmp_path / "result.json"


def _fault_then_two_ranks(job, slow, fault_line, resume_s):
    """Wait for the worker's fault, then for training on the two others; end the slow part
    and the job.  Returns (fault seen, training again, exit code); the job is killed if
    a wait fails."""
    try:
        fault_at = job.wait_for(fault_line, 90)
        resumed = job.wait_for("RESET rank=0 size=2", resume_s)
        slow.unlink()
        return fault_at, resumed, job.finish(120)
    finally:
        if job.proc.poll() is None:
            job.proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_elastic_job_ends_a_rank_holding_its_interpreter_lock_and_goes_on(testbed3, tmp_path):
    """The rank on tbh1 holds its interpreter lock for 90 s at step 5: the others give up
    at the op timeout, the launcher confirms it silent, has tbh1's task end it, and the
    two others train on from the last commit (every step once, the fault-free weights)."""
    from tests.elastic.conftest import check_result

    steps = 40
    job, slow, result = _elastic_job(
        testbed3, tmp_path, [], {"ELASTIC_HOLD_GIL": "tbh1:0:5:90"}, steps
    )
    held, resumed, rc = _fault_then_two_ranks(
        job, slow, "HOLDING the GIL for 90s at step 5", OP_TIMEOUT_S + 40
    )
    text = job.text()
    assert rc == 0, text
    assert "rank 1 on host tbh1 has not answered for" in text, text
    assert "ending worker tbh1:0 so that the others go on without it" in text, text
    assert resumed - held < OP_TIMEOUT_S + 25, (resumed - held, text)
    check_result(result, steps, [3, 2])
    _no_leftovers(testbed3)
    print(f"MEASURED elastic GIL: training again {resumed - held:.1f}s after the wedge")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_elastic_job_leaves_out_a_deadlocked_rank(testbed3, tmp_path):
    """The rank on tbh2 deadlocks in its own code at step 5 (its threads run: it beats but
    never submits).  Rank 0's stall check names it; at the stall shutdown the others give
    up, and the launcher ends it because the stall named it."""
    from tests.elastic.conftest import check_result

    steps = 40
    job, slow, result = _elastic_job(
        testbed3,
        tmp_path,
        ["--stall-check-warning-time-seconds", "2", "--stall-check-shutdown-time-seconds", "6"],
        {"ELASTIC_DEADLOCK": "tbh2:0:5"},
        steps,
    )
    stuck, resumed, rc = _fault_then_two_ranks(job, slow, "DEADLOCKED at step 5", 60)
    text = job.text()
    assert rc == 0, text
    assert "rank 2 on host tbh2 never submitted tensor" in text, text
    assert "ending worker tbh2:0 so that the others go on without it" in text, text
    check_result(result, steps, [3, 2])
    _no_leftovers(testbed3)
    print(f"MEASURED elastic deadlock: training again {resumed - stuck:.1f}s after it")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_elastic_job_leaves_out_a_host_cut_from_another_and_takes_it_back(testbed3, tmp_path):
    """Three 1-slot hosts; tbh1 and tbh2 cannot reach each other for 70 s.  The ranks
    give up at the op timeout and ask for a new round; the launcher probes between the
    hosts, keeps the largest set that reach each other (tbh0, tbh1: rank 0's side) and
    leaves tbh2 out, naming the link.  While the cut lasts, tbh2's cooldowns end in a
    refusal (it still cannot reach tbh1); after the heal it comes back on standby and
    joins.  Every step runs once; the weights are the fault-free run's."""
    from tests.elastic.conftest import check_result

    steps = 1000  # slow (0.2 s a step) until tbh2 is back: more than the test needs
    job, slow, result = _elastic_job(
        testbed3, tmp_path, ["--blacklist-cooldown-range", "10", "12"], {}, steps
    )
    try:
        job.wait_for("TRAIN rank=2 size=3 step=0", 90)
        time.sleep(3)
        testbed3.drop_between("tbh1", "tbh2")
        cut_at = time.monotonic()
        resumed = job.wait_for("RESET rank=0 size=2", OP_TIMEOUT_S + 40)
        time.sleep(max(0.0, 70 - (time.monotonic() - cut_at)))
        testbed3.undrop("tbh1", "tbh2")
        job.wait_for("RESET rank=0 size=3", 60)
        slow.unlink()
        rc = job.finish(120)
    finally:
        testbed3.undrop("tbh1", "tbh2")
        if job.proc.poll() is None:
            job.proc.kill()
    text = job.text()
    assert rc == 0, text
    assert "tbh1 and tbh2 cannot reach each other; tbh2 left out" in text, text
    assert resumed - cut_at < OP_TIMEOUT_S + 30, (resumed - cut_at, text)
    assert "it cannot reach host tbh1" in text, text  # a cooldown ended during the cut
    check_result(result, steps, [3, 2])
    _no_leftovers(testbed3)
    print(
        f"MEASURED elastic cut: training again {resumed - cut_at:.1f}s after the cut; "
        f"refusals during the cut: {text.count('it cannot reach host tbh1')}"
    )
