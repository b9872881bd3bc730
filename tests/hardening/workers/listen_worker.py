"""Prints the addresses this rank listens on after init() (Gloo's listeners among them)
and the interface the launcher chose for Gloo."""

import os

import psutil

import hvdlite.torch as hvd
from hvdlite.common import config as cfg

hvd.init()
listening = sorted(
    {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
)
print(f"LISTEN rank={hvd.rank()} iface={os.environ.get(cfg.GLOO_IFACE)} {listening}", flush=True)
hvd.shutdown()
