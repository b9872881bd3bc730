"""The elastic driver's state machine, driven by a fake discovery and fake workers.

In the spirit of Horovod's test_elastic_driver.py: discovery is polled every 10 ms,
workers are records that the test makes exit; the driver runs on a thread and
the test waits for its rounds.  The discovery-error tests run real scripts.
"""

import dataclasses
import logging
import os
import random
import sys
import threading
import time
import uuid
from typing import Dict, List, Sequence

import pytest

from hvdlite.common.net.framing import new_key
from hvdlite.common.net.service import Client, ServiceError
from hvdlite.runner.tasks.driver_service import DriverService
from hvdlite.runner.agent.hostset import HostSet
from hvdlite.runner.agent.job import run_job
from hvdlite.runner.agent.settings import JobSettings
from hvdlite.runner.agent import state_machine
from hvdlite.runner.agent.state_machine import TRANSITIONS, Agent, JobState
from hvdlite.runner.hosts import HostSlots, place_slots
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.hosts.script import ScriptHosts, parse_discovery_output
from hvdlite.runner.hosts.source import HostDiscoveryError, HostSource
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.processes.rank_output import OutputSink
from hvdlite.runner.tasks.task_service import TaskService
from hvdlite.runner.tasks.ssh import SSHOptions
from hvdlite.runner.hosts import slot_id
from hvdlite.runner.starters.base import Starter
from hvdlite.runner.starters.ssh_tasks import TaskStarter

from conftest import wait_gone

pytestmark = pytest.mark.timeout(10)
INTERVAL = 0.01


def H(spec: str) -> List[HostSlots]:
    """'a:2,b:1' -> hosts."""
    out = []
    for item in filter(None, spec.split(",")):
        name, _, n = item.partition(":")
        out.append(HostSlots(name, int(n or 1)))
    return out


class FakeDiscovery(HostSource):
    def __init__(self, spec: str = "", can_change: bool = True):
        self._hosts = H(spec)
        self._lock = threading.Lock()
        self.can_change = can_change
        self.error = None

    def set(self, spec: str) -> None:
        with self._lock:
            self._hosts = H(spec)

    def find(self):
        with self._lock:
            if self.error:
                raise HostDiscoveryError(self.error, output="bad output")
            return list(self._hosts)


class FakeWorkers(Starter):
    """Workers are entries of ``live``; the test ends them with :meth:`exit`."""

    def __init__(self):
        self.on_exit = lambda: None
        self.live: Dict[tuple, object] = {}
        self.started: List[tuple] = []
        self.stopped: List[tuple] = []
        self.prepared: List[str] = []
        self.refuse_prepare: Dict[str, str] = {}
        self.refuse_start: Dict[str, str] = {}
        self.stop_all_called = False
        self.exit_when_stopped = True
        self._exits = []
        self._lock = threading.Lock()

    def prepare(self, hosts):
        self.prepared += [h.hostname for h in hosts]
        return {
            h.hostname: self.refuse_prepare[h.hostname]
            for h in hosts
            if h.hostname in self.refuse_prepare
        }

    def start(self, slots):
        failed = {}
        for s in slots:
            if s.hostname in self.refuse_start:
                failed[slot_id(s)] = self.refuse_start[s.hostname]
                continue
            with self._lock:
                assert slot_id(s) not in self.live, f"{slot_id(s)} started twice"
                self.live[slot_id(s)] = s
            self.started.append(slot_id(s))
        return failed

    def stop(self, ids: Sequence[tuple]):
        self.stopped += list(ids)
        if self.exit_when_stopped:
            for i in ids:
                self.exit(i, -15)

    def exit(self, sid, code):
        with self._lock:
            assert sid in self.live, f"{sid} is not running"
            del self.live[sid]
            self._exits.append((sid, code))
        self.on_exit()

    def poll(self):
        with self._lock:
            out, self._exits = self._exits, []
        return out

    def stop_all(self):
        self.stop_all_called = True
        for sid in list(self.live):
            self.exit(sid, -15)


class FakeRounds:
    def __init__(self):
        self.rounds: List[list] = []
        self.ids: List[list] = []
        self.reports: Dict[tuple, dict] = {}
        self.unformed = False  # every round "never forms" (its ranks do not all arrive)
        self.standing: set = set()  # slots started ahead of their round
        self.hold_standby = False  # they never come to wait to join
        self.new_processes: list = []  # slots announced to take a new process, in order
        self.asking_round = None  # a round whose members all ask for a new one

    def publish(self, slots, ids):
        self.rounds.append(list(slots))
        self.ids.append(list(ids))
        return len(self.rounds) - 1

    def exit_reports(self):
        return dict(self.reports)

    def formed(self, round_):
        return not self.unformed

    def standby(self, ids):
        self.standing = set(ids)

    def new_process(self, ids):
        self.new_processes.extend(ids)

    def all_asking(self, round_):
        return self.asking_round == round_

    def asking(self, round_):
        return set(self.ids[round_]) if self.asking_round == round_ else set()

    def arrived(self, round_):
        return set() if self.unformed else set(range(len(self.rounds[round_])))

    def set_waker(self, waker):
        self.waker = waker

    def ready(self):
        """Standby workers wait to join at once, unless a test holds them back."""
        return set() if self.hold_standby else set(self.standing)


class Job:
    """A driver on a thread, with its fakes."""

    def __init__(
        self,
        discovery,
        np=2,
        min_np=None,
        max_np=None,
        timeout=5.0,
        reset_limit=None,
        cooldown=None,
        workers=None,
    ):
        self.discovery = discovery
        self.workers = workers or FakeWorkers()
        self.rounds = FakeRounds()
        settings = JobSettings(
            np=np,
            min_np=min_np or np,
            max_np=max_np,
            reset_limit=reset_limit,
            cooldown_range=cooldown,
        )
        self.driver = Agent(
            settings,
            discovery,
            self.workers,
            self.rounds,
            discovery_interval_s=INTERVAL,
            elastic_timeout_s=timeout,
        )
        self.workers.on_exit = self.driver.wake
        self.code = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.code = self.driver.run()

    def ids(self, round_no):
        return self.rounds.ids[round_no]

    def wait_round(self, n, timeout=3.0):
        wait_for(
            lambda: (
                len(self.rounds.rounds) > n
                and self.driver.state is JobState.RUNNING
                or self.driver.state in (JobState.FAILED, JobState.STOPPED)
            ),
            timeout,
        )
        assert len(self.rounds.rounds) > n, (self.driver.state, self.driver.error)
        return self.ids(n)

    def finish(self, timeout=3.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), self.driver.state
        # every transition the driver took is an allowed one
        assert all(new in TRANSITIONS[old] for old, new, _ in self.driver.history)
        assert self.workers.live == {} and self.workers.stop_all_called
        return self.code

    def all_exit(self, code=0):
        for sid in list(self.workers.live):
            self.workers.exit(sid, code)


def wait_for(cond, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


# ------------------------------------------------------------------------------ rounds


def test_first_round_order_sizes_and_success():
    job = Job(FakeDiscovery("a:2,b:1"), np=3, max_np=4)
    assert job.wait_round(0) == [("a", 0), ("a", 1), ("b", 0)]
    slots = job.rounds.rounds[0]
    assert [s.rank for s in slots] == [0, 1, 2] and {s.size for s in slots} == {3}
    assert [(s.local_rank, s.local_size) for s in slots] == [(0, 2), (1, 2), (0, 1)]
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (0, 1), (1, 2)]
    assert job.workers.started == [("a", 0), ("a", 1), ("b", 0)]
    assert job.workers.prepared == ["a", "b"]
    job.workers.exit(("a", 1), 0)
    wait_for(lambda: job.driver.state is JobState.FINISHING)
    job.all_exit(0)
    assert job.finish() == 0 and job.driver.state is JobState.SUCCEEDED
    assert len(job.rounds.rounds) == 1 and job.driver.resets == 0


def test_first_round_uses_at_most_max_np_and_waits_for_np():
    job = Job(FakeDiscovery("a:2,b:2"), np=2, max_np=3)
    assert job.wait_round(0) == [("a", 0), ("a", 1), ("b", 0)]
    job.driver.request_stop()
    assert job.finish() == 130 and job.driver.state is JobState.STOPPED

    disc = FakeDiscovery("a:1")
    job = Job(disc, np=2, min_np=1)
    time.sleep(0.1)
    assert job.rounds.rounds == [] and job.driver.state is JobState.WAITING_FOR_SLOTS
    disc.set("a:1,b:1")
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    job.all_exit(0)
    assert job.finish() == 0


def test_place_slots_interleaved_hosts():
    slots = place_slots([("b", 0), ("a", 0), ("b", 1), ("c", 0), ("a", 1)])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 2, 0, 3),
        (1, 0, 2, 1, 3),
        (2, 1, 2, 0, 2),
        (3, 0, 1, 2, 3),
        (4, 1, 2, 1, 2),
    ]


def test_failed_worker_blacklists_its_slot_host_mates_keep_running(caplog):
    caplog.set_level(logging.INFO, logger="hvdlite.runner.agent")
    disc = FakeDiscovery("a:1,b:2,c:1")
    job = Job(disc, np=4, min_np=2, max_np=8)
    assert job.wait_round(0) == [("a", 0), ("b", 0), ("b", 1), ("c", 0)]
    job.workers.exit(("b", 1), 3)
    # only the slot is kept out: the host's other worker keeps running (and its state)
    assert job.wait_round(1) == [("a", 0), ("b", 0), ("c", 0)]
    assert job.workers.stopped == []
    assert job.driver.hostset.blacklisted == {"b:1": "worker b:1 exited with code 3"}
    assert job.driver.resets == 1
    assert [(s.rank, s.local_rank, s.local_size) for s in job.rounds.rounds[1]] == [
        (0, 0, 1),
        (1, 0, 1),
        (2, 0, 1),
    ]
    # the host's last worker fails too: now the whole host is kept out
    job.workers.exit(("b", 0), 4)
    assert job.wait_round(2) == [("a", 0), ("c", 0)]
    assert job.driver.hostset.is_blacklisted("b")
    # rank 0's host fails: the survivors keep their order, new slots come after them
    disc.set("a:1,b:2,c:1,d:2")
    assert job.wait_round(3) == [("a", 0), ("c", 0), ("d", 0), ("d", 1)]
    job.workers.exit(("a", 0), 1)
    assert job.wait_round(4) == [("c", 0), ("d", 0), ("d", 1)]
    assert job.rounds.rounds[4][0].hostname == "c"  # rank 0 is a survivor
    assert job.workers.started == [("a", 0), ("b", 0), ("b", 1), ("c", 0), ("d", 0), ("d", 1)]
    text = caplog.text
    assert (
        "round 0: worker b:1 (rank 2) exited with code 3; blacklisting slot b:1 for the "
        "rest of the job; the host's other workers b:0 keep running" in text
    )
    assert (
        "round 1: worker b:0 (rank 1) exited with code 4; blacklisting host b for the "
        "rest of the job" in text
    )
    assert "round 1: 3 workers: rank 0 a:0, rank 1 b:0, rank 2 c:0" in text
    job.driver.request_stop()
    assert job.finish() == 130


def test_slot_hole_gets_dense_local_ranks():
    """After a slot in the middle of a host is kept out, the host's survivors still get
    local ranks 0..k-1 (shared memory needs them), joined under their own slot ids."""
    disc = FakeDiscovery("a:3")
    job = Job(disc, np=3, min_np=2)
    assert job.wait_round(0) == [("a", 0), ("a", 1), ("a", 2)]
    job.workers.exit(("a", 1), -9)
    assert job.wait_round(1) == [("a", 0), ("a", 2)]
    assert [(s.rank, s.local_rank, s.local_size) for s in job.rounds.rounds[1]] == [
        (0, 0, 2),
        (1, 1, 2),
    ]
    assert job.workers.stopped == [] and job.driver.resets == 1
    job.driver.request_stop()
    assert job.finish() == 130


def test_short_of_slots_the_agent_says_what_it_waits_for(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="hvdlite.runner.agent")
    monkeypatch.setattr(state_machine, "WAIT_LOG_INTERVAL_S", 0.3)
    disc = FakeDiscovery("a:1")
    job = Job(disc, np=2, min_np=2, timeout=30.0)
    wait_for(lambda: "waiting for 2 slots" in caplog.text)
    assert "before the first round" not in caplog.text
    line = next(r.getMessage() for r in caplog.records if "waiting for 2 slots" in r.getMessage())
    assert (
        "only 1 slot usable, but --min-np is 2 (-np 2 for the first round); hosts: a:1" in line
        and "--elastic-timeout ends the job in" in line
    ), line
    disc.set("a:2")
    assert job.wait_round(0) == [("a", 0), ("a", 1)]
    job.driver.request_stop()
    assert job.finish() == 130


def test_static_job_failure_ends_it_and_names_the_rank():
    disc = FakeDiscovery("a:2", can_change=False)
    workers = FakeWorkers()
    rounds = FakeRounds()
    agent = Agent(JobSettings.static_job(2), disc, workers, rounds, discovery_interval_s=INTERVAL)
    workers.on_exit = agent.wake
    thread = threading.Thread(target=lambda: setattr(agent, "code", agent.run()), daemon=True)
    thread.start()
    wait_for(lambda: agent.state is JobState.RUNNING)
    workers.exit(("a", 1), 3)
    thread.join(5)
    assert agent.code == 3 and agent.state is JobState.FAILED and agent.resets == 0
    assert agent.summary == (
        "hvdlite-run: rank 1 on host a exited with code 3; the other ranks were terminated.\n"
    )
    assert workers.stop_all_called and len(rounds.rounds) == 1


def test_cooldown_returns_the_host():
    disc = FakeDiscovery("a:1,b:1")
    job = Job(disc, np=2, min_np=1, cooldown=(0.3, 0.3))
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    t = time.monotonic()
    job.workers.exit(("a", 0), 2)
    assert job.wait_round(1) == [("b", 0)]
    assert job.driver.hostset.is_blacklisted("a")
    assert job.wait_round(2) == [("b", 0), ("a", 0)]
    assert time.monotonic() - t >= 0.29
    assert not job.driver.hostset.is_blacklisted("a") and job.driver.resets == 2
    job.all_exit(0)
    assert job.finish() == 0


def test_discovery_add_appends_new_slots_up_to_max_np():
    disc = FakeDiscovery("a:2")
    job = Job(disc, np=2, max_np=4)
    assert job.wait_round(0) == [("a", 0), ("a", 1)]
    disc.set("a:2,b:3")
    assert job.wait_round(1) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert job.workers.started == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]  # a kept
    # at --max-np a new host changes nothing
    disc.set("a:2,b:3,c:4")
    time.sleep(0.15)
    assert len(job.rounds.rounds) == 2 and job.driver.resets == 1
    job.all_exit(0)
    assert job.finish() == 0


def test_new_workers_start_ahead_and_join_once_they_wait(caplog):
    """A growing job starts the new slots' workers on standby while the round trains on,
    and publishes the round that takes them only once they wait to join; one that fails
    first blacklists its host, and no round is published for it."""
    caplog.set_level(logging.WARNING, logger="hvdlite.runner.agent")
    disc = FakeDiscovery("a:1,b:1")
    job = Job(disc, np=2, max_np=4, cooldown=(60, 60))
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    job.rounds.hold_standby = True
    disc.set("a:1,b:1,c:1,d:1")
    wait_for(lambda: ("d", 0) in job.workers.started)
    assert job.rounds.standing == {("c", 0), ("d", 0)}
    time.sleep(0.3)
    assert len(job.rounds.rounds) == 1 and job.driver.state is JobState.RUNNING
    assert "starting 2 new workers ahead of the next round (c:0, d:0)" in caplog.text
    job.workers.exit(("d", 0), 1)  # fails before it ever waited to join
    wait_for(lambda: job.driver.hostset.is_blacklisted("d"))
    assert job.rounds.standing == {("c", 0)} and len(job.rounds.rounds) == 1
    job.rounds.hold_standby = False  # c now waits to join: its round opens
    assert job.wait_round(1) == [("a", 0), ("b", 0), ("c", 0)]
    assert job.workers.started.count(("c", 0)) == 1 and job.driver.resets == 1
    job.all_exit(0)
    assert job.finish() == 0


def test_a_failure_while_workers_start_ahead_does_not_wait_for_them():
    """A member fails while a new worker is on standby: the survivors' round opens at once
    without it, and the standby worker joins the round after, once it waits."""
    disc = FakeDiscovery("a:1,b:1")
    job = Job(disc, np=2, min_np=1, max_np=3, cooldown=(60, 60))
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    job.rounds.hold_standby = True
    disc.set("a:1,b:1,c:1")
    wait_for(lambda: ("c", 0) in job.workers.started)
    job.workers.exit(("b", 0), 9)
    assert job.wait_round(1) == [("a", 0)]
    job.rounds.hold_standby = False
    assert job.wait_round(2) == [("a", 0), ("c", 0)]
    job.all_exit(0)
    assert job.finish() == 0


def test_discovery_remove_stops_workers_without_failure():
    disc = FakeDiscovery("a:2,b:1,c:1")
    job = Job(disc, np=2)
    job.workers.exit_when_stopped = False
    assert job.wait_round(0) == [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    disc.set("a:1,c:1")  # b gone, a shrinks to one slot
    assert job.wait_round(1) == [("a", 0), ("c", 0)]
    assert sorted(job.workers.stopped) == [("a", 1), ("b", 0)]
    # they exit on their own terms, with any code: no failure, no blacklist, no round
    job.workers.exit(("b", 0), 7)
    job.workers.exit(("a", 1), -9)
    time.sleep(0.1)
    assert job.driver.hostset.blacklisted == {} and len(job.rounds.rounds) == 2
    # b is back: it gets a slot again (after the survivors)
    disc.set("a:1,c:1,b:1")
    assert job.wait_round(2) == [("a", 0), ("c", 0), ("b", 0)]
    job.all_exit(0)
    assert job.finish() == 0


def test_slot_of_a_worker_still_stopping_is_filled_once_it_exited():
    disc = FakeDiscovery("a:2")
    job = Job(disc, np=1, max_np=4)
    job.workers.exit_when_stopped = False
    assert job.wait_round(0) == [("a", 0), ("a", 1)]
    disc.set("a:1")
    assert job.wait_round(1) == [("a", 0)]
    disc.set("a:2")  # a:1's old process has not exited yet
    time.sleep(0.1)
    assert len(job.rounds.rounds) == 2
    job.workers.exit(("a", 1), -15)
    assert job.wait_round(2) == [("a", 0), ("a", 1)]
    job.all_exit(0)
    assert job.finish() == 0


def test_reset_limit_fails_the_job():
    disc = FakeDiscovery("a:1,b:1,c:1")
    job = Job(disc, np=1, reset_limit=1)
    assert job.wait_round(0) == [("a", 0), ("b", 0), ("c", 0)]
    job.workers.exit(("c", 0), 1)
    assert job.wait_round(1) == [("a", 0), ("b", 0)]
    job.workers.exit(("b", 0), 1)
    assert job.finish() == 1
    assert job.driver.state is JobState.FAILED
    assert "needs reset 2, but --reset-limit is 1" in job.driver.error
    assert "worker b:0 exited with code 1" in job.driver.error


def test_elastic_timeout_with_too_few_slots():
    disc = FakeDiscovery("a:1,b:1")
    job = Job(disc, np=2, timeout=0.3)
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    t = time.monotonic()
    job.workers.exit(("b", 0), 4)
    assert job.finish() == 1
    assert 0.25 <= time.monotonic() - t < 2
    err = job.driver.error
    assert "--elastic-timeout 0.3s" in err and "--min-np is 2" in err, err
    assert "hosts: a:1, b:1; blacklisted: b (worker b:0 exited with code 4)" in err
    assert "only 1 slot usable, but" in err
    assert job.driver.history[-1][:2] == (JobState.WAITING_FOR_SLOTS, JobState.FAILED)


def test_first_round_timeout_starts_with_min_np_or_fails():
    job = Job(FakeDiscovery("a:2"), np=3, min_np=2, timeout=0.2)
    assert job.wait_round(0) == [("a", 0), ("a", 1)]
    job.all_exit(0)
    assert job.finish() == 0
    job = Job(FakeDiscovery("a:1"), np=3, min_np=2, timeout=0.2)
    assert job.finish() == 1
    assert "--elastic-timeout 0.2s" in job.driver.error
    assert "(-np 3 for the first round)" in job.driver.error


def test_fixed_hosts_without_cooldown_fail_at_once():
    job = Job(FixedHosts(H("a:1,b:1")), np=2, timeout=60)
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    job.workers.exit(("a", 0), 1)
    assert job.finish() == 1
    assert "none can come back" in job.driver.error
    assert "--blacklist-cooldown-range" in job.driver.error


def test_worker_that_cannot_start_or_host_that_cannot_prepare():
    workers = FakeWorkers()
    workers.refuse_prepare = {"b": "ssh: connection refused"}
    workers.refuse_start = {"c": "cannot start 'python'"}
    job = Job(FakeDiscovery("a:1,b:1,c:1,d:1"), np=2, workers=workers)
    # b never enters a round; c is in round 0 but its worker did not start: reset
    assert job.wait_round(1) == [("a", 0), ("d", 0)]
    assert job.ids(0) == [("a", 0), ("c", 0), ("d", 0)]
    assert job.driver.hostset.blacklisted == {
        "b": "ssh: connection refused",
        "c": "cannot start 'python'",
    }
    job.all_exit(0)
    assert job.finish() == 0


def test_finishing_ignores_host_changes_and_fails_on_late_failure():
    disc = FakeDiscovery("a:1,b:1,c:1")
    job = Job(disc, np=3)
    assert job.wait_round(0) == [("a", 0), ("b", 0), ("c", 0)]
    job.workers.exit(("a", 0), 0)
    wait_for(lambda: job.driver.state is JobState.FINISHING)
    disc.set("a:1,b:1,c:1,d:1")
    time.sleep(0.1)
    assert len(job.rounds.rounds) == 1
    job.workers.exit(("b", 0), 6)
    assert job.finish() == 6
    assert (
        "worker b:0 (rank 1) of round 0 exited with code 6 after training finished on a:0"
        in job.driver.error
    )


def test_stop_request_ends_every_worker():
    job = Job(FakeDiscovery("a:2,b:2"), np=4)
    job.wait_round(0)
    job.driver.request_stop()
    assert job.finish() == 130
    assert len(job.workers.started) == 4


def test_discovery_error_keeps_hosts(caplog):
    caplog.set_level(logging.WARNING, logger="hvdlite.runner.agent")
    disc = FakeDiscovery("a:1,b:1")
    job = Job(disc, np=2)
    job.wait_round(0)
    disc.error = "boom"
    wait_for(lambda: job.driver._poller.failures >= 3)
    assert len(job.rounds.rounds) == 1 and job.driver.state is JobState.RUNNING
    assert "host discovery failed; keeping the previous hosts (a:1, b:1): boom" in caplog.text
    assert "bad output" in caplog.text
    job.all_exit(0)
    assert job.finish() == 0


def test_discovery_failing_the_same_way_is_logged_once_then_counted(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="hvdlite.runner.agent")
    from hvdlite.runner.agent import poller

    monkeypatch.setattr(poller, "FAILURE_LOG_INTERVAL_S", 0.3)
    disc = FakeDiscovery("a:1,b:1")
    job = Job(disc, np=2)
    job.wait_round(0)
    disc.error = "boom"
    wait_for(lambda: job.driver._poller.failures >= 60, timeout=5)  # ~0.6 s of polls
    full = caplog.text.count("host discovery failed")
    counted = caplog.text.count("host discovery still failing")
    assert full == 1, caplog.text
    assert 1 <= counted <= 4, caplog.text
    disc.error = None
    wait_for(lambda: "host discovery works again after" in caplog.text)
    job.all_exit(0)
    assert job.finish() == 0


def test_a_worker_that_only_gave_up_on_a_peer_keeps_its_host(caplog):
    """Its exit report says a peer failed (e.g. it timed out waiting for the round): the
    slot is started again, nothing is blacklisted."""
    caplog.set_level(logging.WARNING, logger="hvdlite.runner.agent")
    job = Job(FakeDiscovery("a:1,b:1,c:1"), np=2, max_np=2)
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    job.rounds.reports[("b", 0)] = {
        "peer": True,
        "error": "HvdliteTimeoutError: ranks [0] did not reach hvd.init()",
        "at": time.monotonic(),
    }
    job.workers.exit(("b", 0), 1)
    assert job.wait_round(1) == [("a", 0), ("b", 0)]
    assert job.driver.hostset.blacklisted == {}
    assert "after a peer's failure" in caplog.text and "is not blacklisted" in caplog.text
    # a report from an earlier process of the slot does not cover a crash of this one
    job.rounds.reports[("b", 0)]["at"] = 0.0
    job.workers.exit(("b", 0), 1)
    assert job.wait_round(2) == [("a", 0), ("c", 0)]
    assert "b" in job.driver.hostset.blacklisted
    job.all_exit(0)
    assert job.finish() == 0


def test_training_that_ends_before_a_new_round_forms_does_not_wait_for_its_newcomers():
    """The last commit is behind the ranks when a host comes back: the round that adds it
    never forms, so its new worker is stopped, not waited for (it would time out)."""
    disc = FakeDiscovery("a:1,b:1")
    job = Job(disc, np=2, max_np=3)
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    job.rounds.unformed = True
    disc.set("a:1,b:1,c:1")
    assert job.wait_round(1) == [("a", 0), ("b", 0), ("c", 0)]
    job.workers.exit(("a", 0), 0)
    job.workers.exit(("b", 0), 0)
    assert job.finish() == 0, job.driver.error
    assert ("c", 0) in job.workers.stopped


def test_rounds_whose_ranks_keep_giving_up_on_each_other_end_the_job():
    job = Job(FakeDiscovery("a:1,b:1"), np=2, reset_limit=50)
    job.rounds.unformed = True
    for n in range(state_machine.UNFORMED_ROUNDS_LIMIT):
        job.wait_round(n)
        job.rounds.reports[("b", 0)] = {"peer": True, "error": "timed out", "at": time.monotonic()}
        job.workers.exit(("b", 0), 1)
    assert job.finish() == 1
    assert "each ended before all their workers reached init()" in job.driver.error
    assert len(job.rounds.rounds) == state_machine.UNFORMED_ROUNDS_LIMIT


# ------------------------------------------------------------------- discovery scripts


def test_parse_discovery_output():
    text = "# hosts\nnode1:4\n\nnode2   # one slot\nuser@node3:2\nnode1:1\n"
    assert parse_discovery_output(text, default_slots=3) == [
        HostSlots("node1", 5),
        HostSlots("node2", 3),
        HostSlots("node3", 2, "user"),
    ]
    assert parse_discovery_output("") == []
    for bad in ("node1:x", "node1:0", "two words", "a:1:2", "@node"):
        with pytest.raises(HostDiscoveryError, match="line 1"):
            parse_discovery_output(bad)


def _write(path, text):
    """Replace ``path`` at once: the script, polled all the while, must never read a
    truncated file (an empty ``mode`` or ``hosts`` reads as "no hosts")."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def _script(tmp_path, tag):
    """A discovery script whose behaviour the test picks by writing ``mode``."""
    (tmp_path / "mode").write_text("ok")
    (tmp_path / "hosts").write_text("a:1\nb:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"""#!/bin/sh
cd {tmp_path}
case "$(cat mode)" in
  ok) cat hosts ;;
  fail) echo "partial output"; echo "cannot reach the cloud API" >&2; exit 2 ;;
  hang) echo "started"; sh -c "sleep 30; : {tag}" ;;
  garbage) echo "a:1"; echo "this is not a host line" ;;
esac
""")
    script.chmod(0o755)
    return script


@pytest.mark.timeout(20)
def test_bad_discovery_script_keeps_previous_hosts(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="hvdlite.runner.agent")
    tag = uuid.uuid4().hex
    script = _script(tmp_path, tag)
    disc = ScriptHosts(str(script), timeout_s=0.5)
    assert disc.find() == H("a:1,b:1")
    job = Job(disc, np=2, min_np=1)
    assert job.wait_round(0) == [("a", 0), ("b", 0)]

    def bad(mode, *fragments):
        caplog.clear()
        _write(tmp_path / "mode", mode)
        # wait for this mode's own line: a poll begun in the previous mode may end after
        # the write, as one more failure of the old kind (counted, not logged again)
        wait_for(lambda: all(f in caplog.text for f in fragments), timeout=4)
        assert job.driver.state is JobState.RUNNING and len(job.rounds.rounds) == 1
        assert job.workers.stopped == []
        text = caplog.text
        assert "host discovery failed; keeping the previous hosts (a:1, b:1)" in text, text
        for f in fragments:
            assert f in text, text

    t = time.monotonic()
    bad("fail", "exited with code 2", "partial output", "cannot reach the cloud API")
    bad("garbage", "line 2 ('this is not a host line')", "this is not a host line")
    bad("hang", "did not finish within 0.5s", "started")
    assert time.monotonic() - t < 4.5
    # a good answer again is followed
    _write(tmp_path / "hosts", "a:1\n")
    _write(tmp_path / "mode", "ok")
    assert job.wait_round(1) == [("a", 0)]
    assert wait_gone(tag, 2.0) == []  # every hung script's tree was ended
    job.all_exit(0)
    assert job.finish() == 0


def test_script_discovery_slots_per_host_and_close(tmp_path):
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho h1\necho h2:3\n")
    script.chmod(0o755)
    assert ScriptHosts(str(script), default_slots=2).find() == [
        HostSlots("h1", 2),
        HostSlots("h2", 3),
    ]
    missing = ScriptHosts(str(tmp_path / "nope.sh"))
    with pytest.raises(HostDiscoveryError, match="cannot run it"):
        missing.find()
    closed = ScriptHosts(str(script))
    closed.close()
    with pytest.raises(HostDiscoveryError, match="closed"):
        closed.find()
    assert os.access(script, os.X_OK)


# --------------------------------------------------------------------------- blacklist


def test_hostset_cooldown_draw_and_expiry():
    now = [100.0]
    hs = HostSet((5.0, 9.0), clock=lambda: now[0], rng=random.Random(7))
    cooldown = hs.blacklist("a", "worker a:0 exited with code 1")
    assert 5.0 <= cooldown <= 9.0
    assert hs.usable(H("a:1,b:2")) == H("b:2") and hs.may_return()
    assert hs.seconds_to_next_return() == pytest.approx(cooldown)
    now[0] += cooldown - 0.01
    assert hs.expire() == [] and hs.is_blacklisted("a")
    now[0] += 0.02
    assert hs.expire() == ["a"] and hs.usable(H("a:1")) == H("a:1")
    assert hs.seconds_to_next_return() is None and not hs.may_return()
    forever = HostSet(None, clock=lambda: now[0])
    assert forever.blacklist("b", "x") is None
    now[0] += 1e6
    assert forever.expire() == [] and not forever.may_return()


# ------------------------------------------------------------------------ task protocol


def test_task_service_run_again_and_stop():
    key = new_key()
    runs, stops = [], []

    def on_run(slots, command, env):
        runs.append([(s.hostname, s.local_rank) for s in slots])
        return {"failed": [[9, "nope"]]}

    task = TaskService(
        key,
        "jobe",
        0,
        on_run=on_run,
        on_terminate=lambda: None,
        bind_addr="127.0.0.1",
        on_stop=stops.append,
    )
    try:
        c = Client(task.address, key, 5, name="task")
        slot = dataclasses.asdict(place_slots([("h", 0)])[0])
        run = {"op": "run", "slots": [slot], "command": ["x"], "env": {}}
        assert c.request(run)[0]["failed"] == [[9, "nope"]]
        assert c.request(dict(run, slots=[dict(slot, local_rank=1)]))[0]["ok"]
        assert runs == [[("h", 0)], [("h", 1)]]  # a second run starts more
        c.request({"op": "stop", "slots": [["h", 0], ["h", 1]]})
        assert stops == [[("h", 0), ("h", 1)]]
        with pytest.raises(ServiceError, match="slots must be a list"):
            c.request({"op": "stop", "slots": [["h", "0"]]})
        c.close()
    finally:
        task.shutdown()


def test_driver_service_hosts_and_slot_exits():
    key = new_key()
    woken = []
    drv = DriverService(key, "jobe", bind_addr="127.0.0.1", on_exit=lambda: woken.append(1))
    try:
        c = Client(drv.address, key, 5, name="driver")
        with pytest.raises(ServiceError, match="host_index out of range"):
            c.request({"op": "worker_exit", "host_index": 0, "local_rank": 0, "code": 1})
        assert drv.add_host("h1") == 0 and drv.add_host("h2") == 1
        c.request({"op": "worker_exit", "host_index": 1, "rank": 5, "local_rank": 2, "code": -15})
        assert drv.slot_exits == [(("h2", 2), -15)] and woken == [1]
        with pytest.raises(ServiceError, match="local_rank"):
            c.request({"op": "worker_exit", "host_index": 0, "rank": 0, "code": 0})
        c.close()
    finally:
        drv.shutdown()


@pytest.mark.timeout(60)
def test_task_workers_through_local_tasks(capfd, caplog):
    """The task starter without SSH, plugged into the agent by hand: every host (both
    local) gets a task subprocess; a failure on localhost:1 keeps only that slot out,
    and its host mate localhost:0 goes on in the next round."""
    caplog.set_level(logging.WARNING, logger="hvdlite.runner.agent")
    worker = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "workers", "elastic_worker.py"
    )
    env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH") if k in os.environ}
    hosts = H("localhost:2,127.0.0.1:1")
    sink = OutputSink()

    def starter(job):
        return TaskStarter(
            job.key,
            job.job_id,
            job.spec.command,
            lambda: job.job_env(local=False),
            env,
            SSHOptions(),
            start_timeout_s=20,
            sink=sink,
            on_exit=job.wake,
        )

    spec = JobSpec(
        np=3,
        hosts=hosts,
        command=[sys.executable, worker, "--fail", "localhost:1", "--done-after", "1"],
        elastic=JobSettings(np=3, min_np=1),
        host_source=FixedHosts(hosts),
        starter=starter,
    ).with_elastic_timeout(20)
    try:
        code = run_job(spec).exit_code
    finally:
        sink.close()
    out, err = capfd.readouterr()
    err = caplog.text + err
    assert code == 0, err
    assert (
        "round 0: 3 workers: rank 0 localhost:0 (new), rank 1 localhost:1 (new), "
        "rank 2 127.0.0.1:0 (new)" in err
    )
    assert (
        "blacklisting slot localhost:1 for the rest of the job; the host's other "
        "workers localhost:0 keep running" in err
    )
    assert "round 1: 2 workers: rank 0 localhost:0, rank 1 127.0.0.1:0" in err
    assert "[2]<stdout>:JOINED round=1 rank=1 size=2 slot=127.0.0.1:0" in out
    assert "[0]<stdout>:JOINED round=1 rank=0 size=2 slot=localhost:0" in out
    assert "[2]<stdout>:DONE slot=127.0.0.1:0" in out


def test_a_round_whose_members_all_ask_for_a_new_one_is_reopened_as_a_reset():
    """Every rank left the round (a collective failed on all) and none exited: the agent
    reopens the same members, and that counts against --reset-limit."""
    job = Job(FakeDiscovery("a:1,b:1"), np=2, reset_limit=1)
    assert job.wait_round(0) == [("a", 0), ("b", 0)]
    job.rounds.asking_round = 0
    job.rounds.waker()
    assert job.wait_round(1) == [("a", 0), ("b", 0)] and job.driver.resets == 1
    assert job.workers.started == [("a", 0), ("b", 0)]  # nobody started again
    job.rounds.asking_round = 1
    job.rounds.waker()
    wait_for(lambda: job.driver.state is JobState.FAILED)
    assert "--reset-limit is 1" in job.driver.error and "asks for a new one" in job.driver.error
    assert job.finish() == 1
