"""Serve one control-plane listener in its own process, for attacks measured from outside.

Usage: serve_listener.py KIND KEY_HEX [--preauth S] [--max-unauth N] [--nofile N]
Prints ``PORT`` on stdout, serves until stdin closes, then shuts the listener down (which
logs the summary of rejections) and exits.
"""

import argparse
import logging
import resource
import sys

from hvdlite.runner.tasks.driver_service import DriverService
from hvdlite.runner.store.rendezvous import KVStoreService
from hvdlite.runner.tasks.task_service import TaskService


def main():
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["store", "driver", "task"])
    p.add_argument("key")
    p.add_argument("--preauth", type=float, default=10.0)
    p.add_argument("--max-unauth", type=int, default=64)
    p.add_argument("--nofile", type=int)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if a.nofile:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (a.nofile, hard))
    key = bytes.fromhex(a.key)
    kw = dict(max_unauthenticated=a.max_unauth, preauth_timeout_s=a.preauth)
    if a.kind == "store":
        svc = KVStoreService(key, **kw)
    elif a.kind == "driver":
        svc = DriverService(key, "job", bind_addr="127.0.0.1", **kw)
    else:
        svc = TaskService(
            key,
            "job",
            0,
            on_run=lambda *x: None,
            on_terminate=lambda: None,
            bind_addr="127.0.0.1",
            **kw,
        )
    print(svc.address[1], flush=True)
    sys.stdin.read()
    svc.shutdown()


if __name__ == "__main__":
    main()
