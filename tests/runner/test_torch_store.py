"""The launcher's torch store: it listens at once but starts its server (a process that
imports torch) only when a rank connects, serves torch's TCPStore clients, and leaves
nothing behind."""

import time
from datetime import timedelta

import psutil
import pytest

from hvdlite.runner.store.torch_store import MODULE, TorchStore

torch_distributed = pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.timeout(60)


def _servers():
    return [
        p for p in psutil.process_iter(["cmdline"]) if MODULE in " ".join(p.info["cmdline"] or [])
    ]


def test_no_server_until_a_rank_connects_then_torchs_clients_meet_there():
    store = TorchStore(loopback=True)
    try:
        time.sleep(0.6)
        assert _servers() == [], "a job that never calls init_process_group() pays nothing"
        a = torch_distributed.TCPStore(
            "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30)
        )
        b = torch_distributed.TCPStore(
            "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30)
        )
        a.set("from-a", "1")
        assert b.get("from-a") == b"1"
        assert len(_servers()) == 1
    finally:
        store.stop()
    assert _servers() == []


def test_stop_before_any_connection_frees_the_port():
    store = TorchStore(loopback=True)
    port = store.port
    store.stop()
    assert _servers() == []
    assert not [
        c
        for c in psutil.net_connections("tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
    ]
