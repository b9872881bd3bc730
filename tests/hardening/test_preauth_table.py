"""Who gives way when a listener's table of connections waiting for their hello is full."""

import socket
import time

import pytest

from hvdlite.common.net import preauth
from hvdlite.common.net.framing import SecureChannel, new_key
from hvdlite.common.net.kv import KVClient
from hvdlite.runner.store.rendezvous import KVStoreService

pytestmark = pytest.mark.timeout(60)


class _Sock:
    """Just enough of a socket for the table (it keys entries by descriptor)."""

    _next = 1000

    def __init__(self):
        _Sock._next += 1
        self._fd = _Sock._next

    def fileno(self):
        return self._fd


def _pending(source, since):
    return preauth.Pending(_Sock(), (source, 1234), chan=None, since=since)


def test_the_oldest_of_the_busiest_address_gives_way_once_old_enough():
    table = preauth.PreauthTable(per_source=8, min_age_s=0.05)
    b = _pending("10.0.0.2", since=0.5)  # older, but its address holds one place
    a = [_pending("10.0.0.1", since=t) for t in (1.0, 1.1, 1.2)]
    for p in [b] + a:  # in the order they were accepted
        table.add(p)
    assert table.victim("10.0.0.3", capacity=5, now=2.0) is None  # room left
    assert table.victim("10.0.0.3", capacity=4, now=2.0) is a[0]
    assert table.victim("10.0.0.3", capacity=4, now=1.02) is preauth.REFUSE  # all too young
    table.remove(a[0])
    table.remove(a[0])  # idempotent
    assert len(table) == 3 and table.victim("10.0.0.3", 3, now=2.0) is a[1]
    assert [p.since for p in table.expired(now=1.6, timeout_s=0.45)] == [0.5, 1.1]
    assert table.next_deadline(5.0) == 5.5


def test_one_address_never_holds_more_than_its_share():
    table = preauth.PreauthTable(per_source=2, min_age_s=0.0)
    a = [_pending("10.0.0.1", since=t) for t in (1.0, 2.0)]
    for p in a:
        table.add(p)
    # plenty of room in all, but this address is at its share: its own oldest goes
    assert table.victim("10.0.0.1", capacity=100, now=3.0) is a[0]
    assert table.victim("10.0.0.2", capacity=100, now=3.0) is None


def _idle(addr, n):
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(addr, timeout=5))
        except ConnectionResetError:  # refused before connect() returned
            pass
    return socks


def _closed_by_listener(s):
    s.settimeout(5)
    try:
        while s.recv(64):  # the nonce, then nothing until the listener closes
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_an_authenticated_connection_outlives_a_flood_and_a_new_client_gets_in():
    key = new_key()
    store = KVStoreService(key, max_unauthenticated=8, preauth_timeout_s=2.0)
    socks = []
    try:
        held = SecureChannel.connect(store.address, key, 5)  # proves the key now
        held.send({"op": "set", "key": "a"}, b"1")
        assert held.recv(timeout_s=5)[0]["ok"]
        socks = _idle(store.address, 8)  # the table is full
        time.sleep(0.1)  # ...and old enough to give way
        kv = KVClient(store.address, key, timeout_s=10)
        assert kv.get("a") == b"1"  # a newcomer with the key got in
        socks += _idle(store.address, 200)  # 25 times the table
        time.sleep(0.3)
        held.send({"op": "get", "key": "a", "timeout_s": 1}, b"")
        reply, blob = held.recv(timeout_s=5)  # the same connection answers
        assert reply["ok"] and blob == b"1"
        assert store.evicted >= 1 and store.evicted + store.refused >= 200
        kv.close()
        held.close()
        # every stranger was let go: made room for a newcomer, or at the hello deadline
        assert all(_closed_by_listener(s) for s in socks)
    finally:
        for s in socks:
            s.close()
        store.shutdown()
