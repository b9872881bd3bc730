"""Elastic jobs through the real hvdlite-run, with plain-Python workers (no framework).

The workers (workers/elastic_worker.py) join rendezvous rounds through the store
and print each place they get; the test ends the job by creating their done file.
Locally first (two local host names), then over a real sshd (127.0.0.2 is remote).
"""

import os
import re
import signal
import subprocess
import threading
import time
import uuid

import pytest

from conftest import wait_gone, worker
from tests import launching

EW = worker("elastic_worker.py")
ANY_TASK = "hvdlite.runner.tasks.task_service"


class Launch:
    """hvdlite-run as a real process; its lines are collected as they come."""

    def __init__(self, args):
        self.proc = launching.start(args, start_new_session=True)
        self.out, self.err = [], []
        self._threads = [
            threading.Thread(target=self._read, args=(s, dest), daemon=True)
            for s, dest in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, dest):
        for line in stream:
            dest.append(line)

    def wait_for(self, pattern, timeout=20, stream="out"):
        lines = self.out if stream == "out" else self.err
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not any(t.is_alive() for t in self._threads):
                break
            time.sleep(0.02)
        self.kill()
        pytest.fail(
            f"no line matched {pattern!r}\nstdout:\n{''.join(self.out)}\n"
            f"stderr:\n{''.join(self.err)}"
        )

    def finish(self, timeout=20):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"hvdlite-run did not exit\n{''.join(self.err)}")
        for t in self._threads:
            t.join(5)
        return code, "".join(self.out), "".join(self.err)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def joined(out):
    """{(round, slot): rank} from the workers' JOINED lines."""
    return {
        (int(r), slot): int(rank)
        for r, rank, slot in re.findall(r"JOINED round=(\d+) rank=(\d+) size=\d+ slot=(\S+)", out)
    }


def discovery(tmp_path, text):
    (tmp_path / "hosts").write_text(text)
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.timeout(60)
def test_local_failure_blacklists_host_and_survivors_finish(tmp_path):
    done = tmp_path / "done"
    tag = uuid.uuid4().hex
    script = discovery(tmp_path, "localhost:2\n127.0.0.1:1\n")
    job = Launch(
        [
            "-np",
            "3",
            "--min-np",
            "2",
            "--max-np",
            "4",
            "--host-discovery-script",
            script,
            EW,
            "--fail",
            "127.0.0.1:0",
            "--done-file",
            str(done),
            "--tag",
            tag,
        ]
    )
    job.wait_for(r"JOINED round=1 rank=1 size=2 slot=localhost:1")
    job.wait_for(r"JOINED round=1 rank=0 size=2 slot=localhost:0")
    done.write_text("")
    code, out, err = job.finish()
    assert code == 0, err
    j = joined(out)
    assert {k: v for k, v in j.items() if k[0] == 0} == {
        (0, "localhost:0"): 0,
        (0, "localhost:1"): 1,
        (0, "127.0.0.1:0"): 2,
    }
    assert (
        "hvdlite-run: round 0: 3 workers: rank 0 localhost:0 (new), rank 1 localhost:1 "
        "(new), rank 2 127.0.0.1:0 (new)" in err
    )
    assert (
        "hvdlite-run: round 0: worker 127.0.0.1:0 (rank 2) exited with code 3; "
        "blacklisting host 127.0.0.1 for the rest of the job" in err
    )
    assert "hvdlite-run: round 1: 2 workers: rank 0 localhost:0, rank 1 localhost:1" in err
    assert wait_gone(tag, 5) == []


@pytest.mark.timeout(60)
def test_local_discovery_grows_the_job(tmp_path):
    done = tmp_path / "done"
    script = discovery(tmp_path, "localhost:1\n")
    job = Launch(
        [
            "-np",
            "1",
            "--max-np",
            "3",
            "--host-discovery-script",
            script,
            "--slots-per-host",
            "2",
            EW,
            "--done-file",
            str(done),
        ]
    )
    job.wait_for(r"JOINED round=0 rank=0 size=1 slot=localhost:0")
    (tmp_path / "hosts").write_text("localhost:1\n127.0.0.1\n")  # 2 slots by default
    job.wait_for(r"JOINED round=1 rank=2 size=3 slot=127.0.0.1:1")
    job.wait_for(r"JOINED round=1 rank=0 size=3 slot=localhost:0")
    done.write_text("")
    code, out, err = job.finish()
    assert code == 0, err
    # the new workers started ahead of round 1, which opened once both waited to join
    assert (
        "round 0: starting 2 new workers ahead of the next round (127.0.0.1:0, 127.0.0.1:1)" in err
    )
    assert (
        "round 1: 3 workers: rank 0 localhost:0, rank 1 127.0.0.1:0 (was on standby), "
        "rank 2 127.0.0.1:1 (was on standby)" in err
    )


@pytest.mark.timeout(60)
def test_local_too_few_slots_fails_after_elastic_timeout(tmp_path):
    tag = uuid.uuid4().hex
    script = discovery(tmp_path, "localhost:1\n127.0.0.1:1\n")
    job = Launch(
        [
            "-np",
            "2",
            "--max-np",
            "2",
            "--elastic-timeout",
            "1",
            "--host-discovery-script",
            script,
            EW,
            "--fail",
            "localhost:0",
            "--tag",
            tag,
        ]
    )
    code, out, err = job.finish()
    assert code == 1, err
    assert "ENV slot=localhost:0 elastic_timeout=1.0" in out
    assert (
        "hvdlite-run: error: only 1 slot usable, but --min-np is 2; hosts: localhost:1, "
        "127.0.0.1:1; blacklisted: localhost (worker localhost:0 exited with code 3), and "
        "no more became available within "
        "--elastic-timeout 1s" in err
    )
    assert wait_gone(tag, 5) == []


@pytest.mark.timeout(60)
def test_local_sigint_ends_every_worker(tmp_path):
    tag = uuid.uuid4().hex
    job = Launch(["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1", EW, "--tag", tag])
    job.wait_for(r"JOINED round=0 rank=1")
    job.proc.send_signal(signal.SIGINT)
    code, out, err = job.finish(timeout=15)
    assert code == 130 and "received SIGINT" in err
    assert wait_gone(tag, 5) == []


# ---------------------------------------------------------------- over SSH


@pytest.mark.timeout(90)
def test_ssh_failure_and_rejoin_after_cooldown(sshd, tmp_path):
    """127.0.0.2 (remote) fails, is blacklisted, comes back after its cooldown."""
    done = tmp_path / "done"
    tag = uuid.uuid4().hex
    marker = tmp_path / "failed-once"
    job = Launch(
        [
            "-np",
            "2",
            "--min-np",
            "1",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            "--blacklist-cooldown-range",
            "1",
            "1",
            *sshd.ssh_args(),
            EW,
            "--fail",
            "127.0.0.2:0",
            "--fail-once",
            str(marker),
            "--done-file",
            str(done),
            "--tag",
            tag,
        ]
    )
    job.wait_for(r"JOINED round=1 rank=0 size=1 slot=127.0.0.1:0", timeout=40)
    job.wait_for(r"JOINED round=2 rank=1 size=2 slot=127.0.0.2:0", timeout=40)
    job.wait_for(r"JOINED round=2 rank=0 size=2 slot=127.0.0.1:0", timeout=40)
    done.write_text("")
    code, out, err = job.finish(timeout=30)
    assert code == 0, err
    assert (
        "round 0: worker 127.0.0.2:0 (rank 1) exited with code 3; blacklisting host "
        "127.0.0.2 for 1s" in err
    )
    assert "host 127.0.0.2: blacklist cooldown over" in err
    assert "round 2: 2 workers: rank 0 127.0.0.1:0, rank 1 127.0.0.2:0 (was on standby)" in err
    assert wait_gone(tag, 10) == [] and wait_gone(ANY_TASK, 10) == []


@pytest.mark.timeout(90)
def test_ssh_discovery_removes_remote_host(sshd, tmp_path):
    done = tmp_path / "done"
    tag = uuid.uuid4().hex
    script = discovery(tmp_path, "127.0.0.1:1\n127.0.0.2:2\n")
    job = Launch(
        [
            "-np",
            "3",
            "--min-np",
            "1",
            "--host-discovery-script",
            script,
            *sshd.ssh_args(),
            EW,
            "--done-file",
            str(done),
            "--tag",
            tag,
        ]
    )
    job.wait_for(r"JOINED round=0 rank=2 size=3 slot=127.0.0.2:1", timeout=40)
    (tmp_path / "hosts").write_text("127.0.0.1:1\n")
    job.wait_for(r"STALE slot=127.0.0.2:\d|JOINED round=1 rank=0 size=1", timeout=40)
    job.wait_for(r"JOINED round=1 rank=0 size=1 slot=127.0.0.1:0", timeout=40)
    done.write_text("")
    code, out, err = job.finish(timeout=30)
    assert code == 0, err
    assert "round 1: 1 worker: rank 0 127.0.0.1:0" in err
    assert "blacklisting" not in err
    assert wait_gone(tag, 10) == [] and wait_gone(ANY_TASK, 10) == []


@pytest.mark.timeout(60)
def test_ssh_bad_network_interface_fails_the_job(sshd):
    tag = uuid.uuid4().hex
    job = Launch(
        [
            "-np",
            "2",
            "--min-np",
            "1",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            "--network-interfaces",
            "nosuch0",
            *sshd.ssh_args(),
            EW,
            "--tag",
            tag,
        ]
    )
    code, out, err = job.finish(timeout=30)
    assert code == 1, err
    assert (
        "hvdlite-run: error: choosing the network interface between 127.0.0.1, 127.0.0.2 "
        "failed: --network-interfaces nosuch0: none of them is routable" in err
    )
    assert "round 0" not in err
    assert wait_gone(tag, 5) == [] and wait_gone(ANY_TASK, 10) == []


@pytest.mark.timeout(60)
def test_ssh_sigterm_ends_every_worker_and_task(sshd):
    tag = uuid.uuid4().hex
    job = Launch(
        [
            "-np",
            "3",
            "--min-np",
            "1",
            "-H",
            "127.0.0.1:1,127.0.0.2:2",
            *sshd.ssh_args(),
            EW,
            "--tag",
            tag,
        ]
    )
    job.wait_for(r"JOINED round=0 rank=2 size=3 slot=127.0.0.2:1", timeout=40)
    job.proc.send_signal(signal.SIGTERM)
    code, out, err = job.finish(timeout=30)
    assert code == 130 and "received SIGTERM" in err
    assert wait_gone(tag, 10) == [] and wait_gone(ANY_TASK, 10) == []
