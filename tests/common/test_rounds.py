"""World-agnostic init with real processes: ranks learn their place from rendezvous rounds.

The test plays the launcher: it serves a RendezvousService and publishes each
round's slots itself, the way the static launcher (and an elastic driver) does.
"""

import os
import subprocess
import sys
import time

import pytest

from hvdlite.common import config as cfg
from hvdlite.common.net.framing import new_key
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.store.rendezvous import RendezvousService
from tests.common.conftest import ROOT, WORKERS, worker_env

pytestmark = pytest.mark.timeout(120)


def _slot(host, local_rank, rank, size, local_size):
    return SlotInfo(
        hostname=host,
        rank=rank,
        local_rank=local_rank,
        cross_rank=0,
        size=size,
        local_size=local_size,
        cross_size=1,
    )


class _Worker:
    """One rounds_worker.py process claiming ``host``'s slot ``local_rank``."""

    def __init__(self, tmp_path, service, key, host, local_rank, inits):
        self.path = tmp_path / f"{host}.{local_rank}.{time.monotonic_ns()}.out"
        env = worker_env(
            {
                cfg.RENDEZVOUS_ADDR: "127.0.0.1",
                cfg.RENDEZVOUS_PORT: str(service.address[1]),
                cfg.SECRET_KEY: key.hex(),
                cfg.JOB_ID: "rounds",
                cfg.CPU_OPERATIONS: "gloo",
                cfg.HOSTNAME: host,
                cfg.LOCAL_RANK: str(local_rank),
                cfg.START_TIMEOUT: "20",
                # an unnamed op whose auto-name differs between ranks fails fast instead of hanging
                cfg.STALL_CHECK_WARNING_TIME: "1",
                cfg.STALL_CHECK_SHUTDOWN_TIME: "5",
            }
        )
        with open(self.path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(WORKERS, "rounds_worker.py"), str(inits)],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.path.read_text()

    def wait_for(self, text, timeout_s=30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            assert self.proc.poll() is None or text in self.output(), self.output()
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output()}"
            time.sleep(0.05)

    def finish(self, timeout_s=60.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"worker did not finish:\n{self.output()}")


def test_survivor_and_fresh_process_meet_in_the_next_round_and_stale_ones_are_refused(tmp_path):
    key = new_key()
    service = RendezvousService(key, repeat_last=False)
    workers = []
    try:
        service.publish([_slot("hostA", 0, 0, 2, 2), _slot("hostA", 1, 1, 2, 2)])
        survivor = _Worker(tmp_path, service, key, "hostA", 0, inits=2)
        leaver = _Worker(tmp_path, service, key, "hostA", 1, inits=1)
        workers = [survivor, leaver]
        assert leaver.finish() == 0, leaver.output()
        assert "PLACE round=0 rank=1 size=2 sum=3 max=1" in leaver.output()
        survivor.wait_for("PLACE round=0 rank=0 size=2 sum=3 max=1")

        # round 1: the survivor (now at its second init) becomes rank 1 beside a fresh process
        service.publish([_slot("hostB", 0, 0, 2, 1), _slot("hostA", 0, 1, 2, 1)])
        fresh = _Worker(tmp_path, service, key, "hostB", 0, inits=1)
        stale = _Worker(tmp_path, service, key, "hostA", 1, inits=1)  # had a place in round 0
        workers += [fresh, stale]
        assert stale.finish() == 3, stale.output()
        assert "INIT FAILED HvdliteRemovedError" in stale.output()
        assert "round 1 has no place for host hostA local slot 1" in stale.output()
        assert fresh.finish() == 0, fresh.output()
        assert survivor.finish() == 0, survivor.output()
        assert "PLACE round=1 rank=0 size=2 sum=3 max=1" in fresh.output()
        assert "PLACE round=1 rank=1 size=2 sum=3 max=1" in survivor.output()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        service.shutdown()


def test_static_rounds_repeat_the_slots_at_every_init(tmp_path):
    key = new_key()
    service = RendezvousService(key, [_slot("localhost", r, r, 2, 2) for r in range(2)])
    workers = [_Worker(tmp_path, service, key, "localhost", r, inits=3) for r in range(2)]
    try:
        for r, w in enumerate(workers):
            assert w.finish() == 0, w.output()
            for rnd in range(3):
                assert f"PLACE round={rnd} rank={r} size=2 sum=3 max=1" in w.output()
        assert service.round == 2
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        service.shutdown()


def test_a_wait_in_a_replaced_round_ends_at_once_with_the_newest_round():
    """Elastic rounds: a rank waiting for peers of round 0 is told as soon as round 1 is
    published (its peers may be dead), instead of waiting out its timeout."""
    import threading

    from hvdlite.common.exceptions import HvdliteRoundSupersededError
    from hvdlite.common.net.kv import KVClient

    key = new_key()
    service = RendezvousService(key, repeat_last=False, job_id="j")
    try:
        slots = [SlotInfo("a", 0, 0, 0, 2, 2, 1), SlotInfo("a", 1, 1, 0, 2, 2, 1)]
        service.publish(slots)
        client = KVClient(service.address, key, timeout_s=30.0, prefix="j/round0/")
        client.round = 0
        client.set("arrived/0", b"a")
        assert not service.formed(0)
        threading.Timer(0.3, lambda: service.publish(slots[:1])).start()
        started = time.monotonic()
        with pytest.raises(
            HvdliteRoundSupersededError, match="round 0 was replaced by round 1"
        ) as info:
            client.wait(["arrived/0", "arrived/1"], 30.0)
        assert info.value.newest == 1 and time.monotonic() - started < 5
        # a wait that names no round (a static job's) is not cut short
        plain = KVClient(service.address, key, timeout_s=30.0, prefix="j/round1/")
        plain.set("arrived/0", b"a")
        plain.wait(["arrived/0"], 1.0)
        assert service.formed(1)
        client.close()
        plain.close()
    finally:
        service.shutdown()


def _join(client, host, local_rank, after, token, timeout_s=10.0):
    reply, _ = client.request(
        {
            "op": "join_round",
            "after": after,
            "hostname": host,
            "local_rank": local_rank,
            "timeout_s": timeout_s,
            "token": token,
        },
        timeout_s=timeout_s + 5,
    )
    return reply


def test_one_process_per_slot_a_cut_off_one_cannot_join_beside_its_replacement():
    """A slot is bound to the first process that joins with it; after the agent starts a
    new process there, the old one (a partition's far side, healed) is told to leave, and
    the new one binds the slot."""
    from hvdlite.common.net.service import Client

    key = new_key()
    service = RendezvousService(key, repeat_last=False, job_id="j")
    client = Client(service.address, key, 20.0)
    try:
        service.publish([SlotInfo("a", 0, 0, 0, 1, 1, 1)])
        assert _join(client, "a", 0, -1, "old")["round"] == 0
        other = _join(client, "a", 0, -1, "intruder")
        assert "another process now holds host a local slot 0" in other["removed"], other
        service.publish([SlotInfo("a", 0, 0, 0, 1, 1, 1)])
        assert _join(client, "a", 0, 0, "old")["round"] == 1  # a survivor rejoins
        service.new_process([("a", 0)])  # the agent replaced it
        service.publish([SlotInfo("a", 0, 0, 0, 1, 1, 1)])
        stale = _join(client, "a", 0, 1, "old")
        assert "cut off from the job" in stale["removed"], stale
        assert _join(client, "a", 0, -1, "new")["round"] == 2
        assert "removed" in _join(client, "a", 0, 1, "old")
    finally:
        client.close()
        service.shutdown()


def test_a_standby_slot_waits_for_its_round_and_counts_as_ready():
    """A worker started ahead of its round is not told to leave: its join waits (and the
    agent sees it ready) until a round with its place opens; taken off standby, it leaves.
    A round watcher's await_round answers as soon as a round opens."""
    import threading

    from hvdlite.common.net.service import Client

    key = new_key()
    service = RendezvousService(key, repeat_last=False, job_id="j")
    clients = [Client(service.address, key, 20.0) for _ in range(3)]
    try:
        service.publish([SlotInfo("a", 0, 0, 0, 1, 1, 1)])
        service.standby([("b", 0), ("c", 0)])
        answers = {}
        joins = [
            threading.Thread(
                target=lambda h=h, c=c: answers.__setitem__(h, _join(c, h, 0, -1, "t" + h)),
                daemon=True,
            )
            for h, c in (("b", clients[0]), ("c", clients[1]))
        ]
        for t in joins:
            t.start()
        deadline = time.monotonic() + 5
        while service.ready() != {("b", 0), ("c", 0)} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert service.ready() == {("b", 0), ("c", 0)} and answers == {}
        assert (
            clients[2].request({"op": "await_round", "after": 0, "timeout_s": 0.2})[0]["round"] == 0
        )  # nothing newer yet
        waiter = threading.Thread(
            target=lambda: answers.__setitem__(
                "await",
                clients[2].request({"op": "await_round", "after": 0, "timeout_s": 10})[0]["round"],
            ),
            daemon=True,
        )
        waiter.start()
        time.sleep(0.2)
        service.standby([("b", 0)])  # c is dropped
        service.publish([_slot("a", 0, 0, 2, 1), _slot("b", 0, 1, 2, 1)])
        for t in joins + [waiter]:
            t.join(5)
        assert "b" in answers, answers
        assert answers["b"]["round"] == 1 and answers["b"]["rank"] == 1, answers
        assert "round 1 has no place for host c local slot 0" in answers["c"]["removed"]
        assert answers["await"] == 1
        assert service.ready() == set()
    finally:
        for c in clients:
            c.close()
        service.shutdown()


def test_the_store_tells_when_every_member_asks_for_a_new_round():
    """A collective failed on every rank and no process left: nobody would publish a round
    (membership did not change), so the store wakes the agent once every member asks for
    one -- not before -- and the agent reopens the same members."""
    import threading

    from hvdlite.common.net.service import Client

    key = new_key()
    service = RendezvousService(key, repeat_last=False, job_id="j")
    woken = threading.Event()
    service.set_waker(woken.set)
    clients = [Client(service.address, key, 20.0) for _ in range(2)]
    try:
        slots = [_slot("a", 0, 0, 2, 1), _slot("b", 0, 1, 2, 1)]
        service.publish(slots)
        for host, c in zip("ab", clients):
            assert _join(c, host, 0, -1, "t" + host)["round"] == 0
        answers = {}
        asks = [
            threading.Thread(
                target=lambda h=h, c=c: answers.__setitem__(h, _join(c, h, 0, 0, "t" + h)),
                daemon=True,
            )
            for h, c in zip("ab", clients)
        ]
        asks[0].start()
        time.sleep(0.3)
        assert not woken.is_set() and not service.all_asking(0)  # one asked
        asks[1].start()
        assert woken.wait(5) and service.all_asking(0)
        service.publish(slots)  # what the agent does
        for t in asks:
            t.join(5)
        assert answers["a"]["round"] == answers["b"]["round"] == 1, answers
        assert not service.all_asking(1)
    finally:
        for c in clients:
            c.close()
        service.shutdown()
