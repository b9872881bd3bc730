"""Helpers for the launcher tests (the real sshd fixture is in tests/conftest.py)."""

import os
import time

import psutil

from tests import launching
from tests.conftest import free_port  # noqa: F401  (the launcher tests import it from here)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKERS = os.path.join(HERE, "workers")


def run_launcher(args, timeout=60, env=None, **kw):
    """Run hvdlite-run as a real process; returns CompletedProcess (text)."""
    return launching.run(args, env=env, timeout=timeout, **kw)


def worker(name: str) -> str:
    return os.path.join(WORKERS, name)


def procs_with(token: str):
    """Live processes whose command line contains ``token``."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(token in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def wait_gone(token: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = procs_with(token)
        if not left:
            return []
        time.sleep(0.1)
    return procs_with(token)
