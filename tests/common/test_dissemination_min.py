"""The control vector's dissemination MIN over real Gloo process groups.

Every rank is a thread of this process with its own ``ProcessGroupGloo`` (TCP over loopback),
so groups of any size connect in milliseconds.  The last test builds the real
:class:`GlooBackend` of a 4-rank job on two (named) hosts with shared memory on, the way
``hvdlite-run -H a:2,b:2`` places it, with the test serving the rendezvous itself.
"""

import datetime
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hvdlite.common.backend.gloo import ExchangeGroup, GlooBackend, dissemination_min_
from hvdlite.common.config import Config
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.net.framing import new_key
from hvdlite.runner.hosts.slots import place_slots
from hvdlite.runner.store.rendezvous import RendezvousService

pytestmark = pytest.mark.timeout(60)

VECTOR = 88  # the control vector's length with the default cache
INT32 = np.iinfo(np.int32)


def _on_threads(fn, ranks, timeout_s=20.0):
    """``fn(rank)`` on one thread per rank; (results, errors) by rank.  Fails the test if a
    thread is still running after ``timeout_s`` (a hang)."""
    results, errors = {}, {}

    def body(r):
        try:
            results[r] = fn(r)
        except Exception as exc:  # returned to the test, which checks it
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in zip(ranks, threads) if t.is_alive()]
    assert not hung, f"ranks {hung} still running after {timeout_s:g}s"
    return results, errors


def _groups(size, timeout_s):
    """One connected ProcessGroupGloo per rank, over one in-process store; the members are
    named as job ranks 10, 11, ... on hosts h0, h1, ... (not their indices in the group)."""
    store = dist.HashStore()

    def connect(r):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(dist.PrefixStore("g/", store), r, size, opts)

    pgs, errors = _on_threads(connect, range(size))
    assert not errors, errors
    names = [f"rank {10 + i} (h{i})" for i in range(size)]
    return [ExchangeGroup(pgs[r], r, size, names, f"rank {10 + r}", timeout_s) for r in range(size)]


@pytest.mark.parametrize("size", [2, 3, 5, 6])
def test_min_equals_numpy_at_sizes_that_are_not_powers_of_two(size):
    groups = _groups(size, timeout_s=10.0)
    data = np.random.default_rng(size).integers(-1000, 1000, (size, VECTOR), dtype=np.int32)
    data[size - 1, 0], data[0, 1] = INT32.min, INT32.max  # the extremes travel intact
    expected = data.min(axis=0)
    for _ in range(3):  # the same groups, cycle after cycle

        def run(r):
            t = torch.from_numpy(data[r].copy())
            dissemination_min_(groups[r], t)
            return t.numpy()

        results, errors = _on_threads(run, range(size))
        assert not errors, errors
        for r in range(size):
            np.testing.assert_array_equal(results[r], expected, err_msg=f"rank {r}")
        data = np.roll(data, 1, axis=0)  # another rank holds each minimum next time


def test_an_absent_peer_is_named_within_the_op_timeout():
    """Rank 12 never takes part: the two others fail after the 1 s op timeout, not later,
    naming it by its job rank and host and naming the flag."""
    groups = _groups(3, timeout_s=1.0)
    started = time.monotonic()
    _, errors = _on_threads(
        lambda r: dissemination_min_(groups[r], torch.zeros(VECTOR, dtype=torch.int32)), [0, 1]
    )
    elapsed = time.monotonic() - started
    assert sorted(errors) == [0, 1] and 0.9 < elapsed < 5, (errors, elapsed)
    for r, exc in errors.items():
        assert isinstance(exc, HvdliteInternalError), repr(exc)
        assert str(exc).startswith(f"rank {10 + r}: Gloo exchange with rank 12 (h2) failed"), exc
        assert "--op-timeout-seconds (1s)" in str(exc)


def test_a_closed_peer_is_named_at_once():
    """A peer whose group is gone (its sockets closed, as when its process exits) fails the
    exchange at once, long before the op timeout, and the error still names it."""
    groups = _groups(3, timeout_s=30.0)
    groups[2].pg.shutdown()
    groups[2] = None  # the last reference: Gloo closes its pairs
    started = time.monotonic()
    _, errors = _on_threads(
        lambda r: dissemination_min_(groups[r], torch.zeros(VECTOR, dtype=torch.int32)), [0, 1]
    )
    assert time.monotonic() - started < 10
    assert sorted(errors) == [0, 1], errors
    for exc in errors.values():
        assert isinstance(exc, HvdliteInternalError), repr(exc)
        assert "Gloo exchange with rank 12 (h2) failed" in str(exc)


def test_two_hosts_with_shared_memory_reduce_across_hosts_by_dissemination():
    """The real backend of a job placed host by host in turn (hostA: ranks 0 and 2, hostB:
    1 and 3), so the cross-host groups' indices are not job ranks.  The MIN is right with the
    dissemination and with Gloo's ring (the benchmark's knob); when rank 3 closes, its
    cross-host peer rank 2 is told by an exchange that names rank 3 and its host."""
    placed = [("hostA", 0), ("hostB", 0), ("hostA", 1), ("hostB", 1)]
    key = new_key()
    service = RendezvousService(key, place_slots(placed), job_id="dissem")
    backends = {}

    def join(r):
        host, local = placed[r]
        config = Config(
            rendezvous_addr="127.0.0.1",
            rendezvous_port=service.address[1],
            secret_key=key,
            job_id="dissem",
            hostname=host,
            local_rank=local,
            start_timeout_s=20.0,
            op_timeout_s=1.0,
        )
        backends[r] = GlooBackend.for_job(config, -1)

    try:
        _, errors = _on_threads(join, range(4))
        assert not errors, errors
        assert [
            b._shm is not None and b._cross_pg is not None for _, b in sorted(backends.items())
        ] == [True] * 4
        assert backends[2]._cross_peers.names == ["rank 2 (hostA)", "rank 3 (hostB)"]
        assert backends[1]._cross_peers.names == ["rank 0 (hostA)", "rank 1 (hostB)"]
        data = np.random.default_rng(4).integers(-99, 99, (4, VECTOR), dtype=np.int32)
        for by_dissemination in (True, False):
            for b in backends.values():
                b.cross_min_by_dissemination = by_dissemination
            results, errors = _on_threads(
                lambda r: backends[r].control_allreduce_min(data[r].copy()), range(4)
            )
            assert not errors, errors
            for r in range(4):
                np.testing.assert_array_equal(
                    results[r], data.min(axis=0), err_msg=f"rank {r}, {by_dissemination}"
                )
            data = np.roll(data, 1, axis=0)
        for b in backends.values():
            b.cross_min_by_dissemination = True
        backends.pop(3).close()
        _, errors = _on_threads(
            lambda r: backends[r].control_allreduce_min(data[r].copy()), range(3)
        )
        assert sorted(errors) == [0, 1, 2], errors
        assert str(errors[2]).startswith("rank 2: Gloo exchange with rank 3 (hostB) failed"), (
            errors[2]
        )
    finally:
        for b in backends.values():
            b.close()
        service.shutdown()
