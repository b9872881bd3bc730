"""Grey failures: ranks alive but not progressing, seen from outside them.

The store's liveness view (``store/liveness.py``) fed with the pollers' real requests,
the agent's verdicts on it (``agent/wedged.py``), the summary line that names the rank
the others waited for (``agent/blame.py``), and real np=2 jobs: a rank that holds the
interpreter lock in a C call, and a stall shutdown, each named in the last line."""

import re
import time

import pytest

from hvdlite.runner.agent import blame
from hvdlite.runner.agent.wedged import WedgeWatch
from hvdlite.runner.store.liveness import Liveness

from conftest import run_launcher, wait_gone, worker

WEDGE = worker("wedge_worker.py")
STALL = worker("stall_worker.py")
A, B, C = ("h0", 0), ("h0", 1), ("h1", 0)


def poll(live, sid, rank, pid, round_=0, progress=1, leaving=False):
    header = {
        "op": "stacks_wanted",
        "rank": rank,
        "pid": pid,
        "slot": list(sid),
        "round": round_,
        "progress": progress,
    }
    if leaving:
        header["leaving"] = True
    live.take_poll(header)


def stall_summary(live, missing, tensor="grad.w"):
    live.take_stall(
        {
            "op": "stack_report",
            "kind": "stall",
            "id": 1,
            "rank": 0,
            "expected": missing,
            "tensors": [[tensor, [0], missing, 4.0]],
        }
    )


# ---------------------------------------------------------------- the store's view


def test_a_slot_that_stops_polling_is_silent_unless_it_said_it_leaves():
    live = Liveness(silent_s=0.2)
    poll(live, A, 0, 100)
    poll(live, B, 1, 101)
    assert live.silent_for(A) is None
    time.sleep(0.3)
    poll(live, B, 1, 101, leaving=True)  # a shutdown or a reset: no verdict
    assert live.silent_for(A) >= 0.2
    time.sleep(0.3)
    assert live.silent_for(B) is None
    poll(live, A, 0, 100)  # it runs again
    assert live.silent_for(A) is None
    assert live.silent_for(C) is None  # never polled: never called silent
    assert live.heard_from_host("h0", 1.0) and not live.heard_from_host("h1", 1.0)


def test_a_new_process_on_the_slot_starts_over():
    live = Liveness(silent_s=0.1)
    poll(live, A, 0, 100)
    time.sleep(0.2)
    assert live.silent_for(A) is not None
    live.forget(A)
    assert live.silent_for(A) is None and live.beat(A) is None
    poll(live, A, 0, 200)
    assert live.beat(A).pid == 200


def test_malformed_polls_and_stalls_are_ignored():
    live = Liveness()
    live.take_poll({"op": "stacks_wanted", "rank": 0})  # an older poller
    live.take_poll({"op": "stacks_wanted", "rank": "0", "pid": 1, "slot": ["h", 0]})
    live.take_poll({"op": "stacks_wanted", "rank": 0, "pid": 1, "slot": ["h" * 300, 0]})
    live.take_stall({"kind": "stall", "expected": "1", "tensors": []})
    assert live.beat(("h", 0)) is None


def test_a_stall_names_the_slots_of_the_missing_ranks_in_the_newest_round():
    live = Liveness()
    poll(live, A, 0, 100, round_=1)
    poll(live, B, 1, 101, round_=1)
    poll(live, C, 1, 102, round_=0)  # an older round's rank 1: not this one
    since = time.monotonic()
    stall_summary(live, [1])
    verdict = live.missing(B, since)
    assert verdict is not None and verdict.tensors == ["grad.w"] and verdict.rank == 1
    assert live.missing(C) is None and live.missing(A) is None
    assert live.missing(B, since=time.monotonic() + 1) is None  # an older stall


def test_liveness_observes_the_ops_and_still_answers_them():
    live = Liveness()
    seen = []
    ops = live.wrap(
        {
            "stacks_wanted": lambda h, b: (seen.append(h) or {"wanted": 0}, b""),
            "other": lambda h, b: ({}, b""),
        }
    )
    reply = ops["stacks_wanted"](
        {"op": "stacks_wanted", "rank": 0, "pid": 7, "slot": ["h0", 0]}, b""
    )
    assert reply == ({"wanted": 0}, b"") and len(seen) == 1
    assert live.beat(A).pid == 7 and set(ops) == {"stacks_wanted", "other"}


# ---------------------------------------------------------------- the agent's verdicts


def rank_of(order):
    return lambda sid: order.index(sid)


def test_members_are_ended_only_once_the_others_give_up_and_they_are_confirmed_stuck():
    live = Liveness(silent_s=0.1)
    watch = WedgeWatch(live, op_timeout_s=30.0, write=lambda text: None)
    watch.new_round(0)
    order = [A, B, C]
    for sid in order:
        poll(live, sid, order.index(sid), 100 + order.index(sid))
    time.sleep(0.2)
    poll(live, A, 0, 100)
    poll(live, C, 2, 102)
    # B is silent, but nobody gave up on it yet: the job may still be fine
    assert watch.to_end(order, set(), rank_of(order)) == []
    # A gave up and asks for a new round; C is neither silent nor named: not ended
    ended = watch.to_end(order, {A}, rank_of(order))
    assert [sid for sid, _ in ended] == [B]
    assert "rank 1 on host h0 has not answered" in ended[0][1]
    assert "ranks [0] gave up waiting for it" in ended[0][1]


def test_a_member_a_stall_of_this_round_named_is_ended_when_the_others_ask():
    live = Liveness()
    watch = WedgeWatch(live, op_timeout_s=30.0, write=lambda text: None)
    order = [A, B]
    poll(live, A, 0, 100)
    poll(live, B, 1, 101)
    stall_summary(live, [1])
    watch.new_round(1)  # the stall was in an older round
    assert watch.to_end(order, {A}, rank_of(order)) == []
    stall_summary(live, [1], tensor="grad.b")
    ended = watch.to_end(order, {A}, rank_of(order))
    assert [sid for sid, _ in ended] == [B] and "never submitted tensor 'grad.b'" in ended[0][1]


def test_a_member_that_never_asks_is_ended_after_the_op_timeout_and_a_grace():
    live = Liveness()
    watch = WedgeWatch(live, op_timeout_s=0.0, write=lambda text: None)
    order = [A, B]
    poll(live, A, 0, 100)
    poll(live, B, 1, 101)
    watch._asking_since[A] = time.monotonic() - 11.0  # A asked 11 s ago (grace 10 s)
    ended = watch.to_end(order, {A}, rank_of(order))
    assert [sid for sid, _ in ended] == [B] and "did not leave the failed round" in ended[0][1]


def test_a_silent_member_is_reported_once_per_silence_with_its_outside_stack():
    live = Liveness(silent_s=0.1)
    written = []
    stacks = {B: "STACK-OF-B"}
    watch = WedgeWatch(
        live,
        outside=lambda ids, timeout_s: {i: stacks[i] for i in ids},
        stack_lines=lambda stack: [f"    {stack}"],
        write=written.append,
    )
    order = [A, B]
    poll(live, A, 0, 100)
    poll(live, B, 1, 4242)
    time.sleep(0.2)
    poll(live, A, 0, 100)
    for _ in range(3):
        watch.report_silent(order, rank_of(order))
    deadline = time.monotonic() + 5
    while not written and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    assert len(written) == 1, written
    assert "rank 1 on host h0 (pid 4242) has not answered" in written[0]
    assert "STACK-OF-B" in written[0] and "py-spy" in written[0]


def test_culprits_name_silent_and_missing_members_else_those_that_never_reached_init():
    live = Liveness(silent_s=0.1)
    watch = WedgeWatch(live, write=lambda text: None)
    order = [A, B, C]
    assert watch.culprits(order, rank_of(order), arrived={0, 2}) == [
        (B, "never reached hvd.init()")
    ]
    poll(live, A, 0, 100)
    poll(live, C, 2, 102)
    time.sleep(0.2)
    poll(live, A, 0, 100)
    stall_summary(live, [0])
    found = dict(watch.culprits(order, rank_of(order), arrived={0, 2}))
    assert set(found) == {A, C}
    assert found[C].startswith("stopped answering (pid 102)")
    assert found[A].startswith("never submitted tensor 'grad.w' (pid 100)")


def test_a_member_whose_process_exited_is_no_silent_culprit():
    """A rank that exits without its last "leaving" poll (sys.exit right after a peer's
    failure) stops beating too: only a running process that went silent is stuck."""
    live = Liveness(silent_s=0.1)
    watch = WedgeWatch(live, write=lambda text: None)
    order = [A, B]
    poll(live, A, 0, 100)
    poll(live, B, 1, 101)
    time.sleep(0.2)
    poll(live, A, 0, 100)
    assert watch.culprits(order, rank_of(order), running={A}) == []
    assert [sid for sid, _ in watch.culprits(order, rank_of(order), running={A, B})] == [B]
    # nor is one killed before it reached init(): its exit names it
    assert watch.culprits([A, C], rank_of([A, C]), arrived={0}, running={A}) == []
    assert watch.culprits([A, C], rank_of([A, C]), arrived={0}, running={A, C}) == [
        (C, "never reached hvd.init()")
    ]


def test_the_summary_names_the_rank_the_others_waited_for_and_who_only_waited():
    summary = blame.FailureSummary(
        ranks={A: (0, "h0"), B: (1, "h0"), C: (2, "h1")},
        exits=[(A, 1)],
        reports=lambda: {A: {"peer": True, "error": "HvdliteInternalError: timed out", "at": 1.0}},
        stopped=list,
        culprits=lambda: [(C, "stopped answering (pid 9)")],
    )
    line = summary.line((A, 1))
    assert line.startswith(
        "hvdlite-run: rank 2 on host h1 stopped answering (pid 9); "
        "ranks 0, 1 only waited for it (rank 0 then exited with code 1: "
        "HvdliteInternalError: timed out)"
    ), line
    # a rank's own failure still comes first
    own = blame.FailureSummary(
        ranks={A: (0, "h0"), C: (2, "h1")},
        exits=[(A, 1)],
        reports=lambda: {A: {"peer": False, "error": "ValueError: bad", "at": 1.0}},
        stopped=list,
        culprits=lambda: [(C, "stopped answering (pid 9)")],
    )
    assert "ValueError: bad" in own.line((A, 1))


# ---------------------------------------------------------------- real jobs


@pytest.mark.timeout(120)
def test_a_rank_holding_the_interpreter_lock_is_named_with_its_pid_not_the_rank_that_waited():
    started = time.monotonic()
    proc = run_launcher(
        ["-np", "2", "--op-timeout-seconds", "12", "python", WEDGE, "1", "60"], timeout=100
    )
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    pid = re.search(r"WEDGED rank=1 pid=(\d+)", out).group(1)
    report = re.search(
        r"rank 1 on host \S+ \(pid (\d+)\) has not answered for \d+s while "
        r"its process runs",
        out,
    )
    assert report and report.group(1) == pid, out
    last = out.strip().splitlines()[-1]
    assert re.match(
        rf"hvdlite-run: rank 1 on host \S+ stopped answering \(pid {pid}\): no "
        rf"thread of it ran for \d+s",
        last,
    ), last
    assert "rank 0 only waited for it" in last, last
    assert took < 12 + 30, took
    assert not wait_gone(WEDGE, 10.0), "the wedged rank was left running"


@pytest.mark.timeout(120)
def test_a_stall_shutdown_blames_the_missing_rank_not_rank_0():
    proc = run_launcher(
        [
            "-np",
            "2",
            "--stall-check-warning-time-seconds",
            "2",
            "--stall-check-shutdown-time-seconds",
            "5",
            "python",
            STALL,
            "stall",
            "60",
        ],
        timeout=100,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    last = out.strip().splitlines()[-1]
    assert re.match(
        r"hvdlite-run: rank 1 on host \S+ never submitted tensor 'stall.grad' "
        r"\(pid \d+\), which the others waited for \d+s; rank 0 only waited for "
        r"it",
        last,
    ), last
    assert not wait_gone(STALL, 10.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_never_reaches_init_is_blamed_not_the_rank_that_waited_there():
    proc = run_launcher(
        ["-np", "2", "--start-timeout", "8", "python", WEDGE, "late", "60"], timeout=100
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    last = out.strip().splitlines()[-1]
    assert re.match(
        r"hvdlite-run: rank 1 on host \S+ never reached hvd.init\(\); rank 0 only "
        r"waited for it \(rank 0 then exited with code 1: ",
        last,
    ), last
    assert not wait_gone(WEDGE, 10.0)
