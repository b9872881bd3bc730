"""The namespaced testbed (tests/testbed) as a fixture, and a launcher run on its first host."""

import os
import subprocess
import sys
import threading
import time

import pytest

from tests import launching
from tests.testbed import Testbed, TestbedUnavailable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


@pytest.fixture(scope="module")
def testbed():
    """Two hosts, tbh0 and tbh1, each in its own namespace with its own sshd."""
    try:
        tb = Testbed(2)
    except TestbedUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield tb
    finally:
        tb.close()


class Job:
    """``hvdlite-run`` started on a testbed host, its output lines timestamped."""

    def __init__(self, tb, host, launcher_args, script, script_args=(), env=None):
        self.proc = tb.popen(
            host,
            launching.command(
                *launcher_args,
                *tb.ssh_args(),
                sys.executable,
                os.path.join(WORKERS, script),
                *script_args,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=launching.environment(env, pythonpath=[REPO]),
        )
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in self.lines:
                if text in line:
                    return at
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r} within {timeout_s}s:\n{self.text()}")

    def finish(self, timeout_s):
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the job did not end within {timeout_s}s:\n{self.text()}")
        self._reader.join(5)
        return rc

    def text(self):
        return "\n".join(line for _, line in self.lines)


def cmdline(pid):
    """A process's command line ("" once it is gone)."""
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
    except OSError:
        return ""


def leftovers(tb, host):
    """Processes on ``host`` other than its own sshd listener."""
    left = []
    for pid in tb.pids(host):
        cmd = cmdline(pid)
        if not cmd:
            continue
        if not cmd.endswith("[listener] 0 of 10-100 startups") and "sshd -D -e -f" not in cmd:
            left.append(f"{pid}: {cmd[:120]}")
    return left
