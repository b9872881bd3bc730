"""Jobs between two namespaced hosts (tests/testbed): each host has its own address and
sshd, and the traffic between them crosses a veth link through a bridge, which the tests
shape, make lossy or cut."""

import os
import re
import time

import pytest

from .conftest import REPO, Job, cmdline, leftovers

ELASTIC_WORKERS = os.path.join(REPO, "tests", "elastic", "workers")

HOSTS = ["-np", "4", "-H", "tbh0:2,tbh1:2"]


@pytest.mark.timeout(120)
def test_a_job_across_two_hosts_sums_right_and_leaves_nothing(testbed):
    job = Job(testbed, "tbh0", HOSTS, "allreduce_steps.py", ["20", "1000"])
    assert job.finish(100) == 0, job.text()
    text = job.text()
    assert len(re.findall(r"SUMS_OK rank=\d", text)) == 4, text
    assert "using interface eth0" in text, text
    # two ranks on each host: cross ranks 0 and 1 twice each
    assert sorted(re.findall(r"cross=(\d)", text)) == ["0", "0", "1", "1"], text
    time.sleep(1)
    assert leftovers(testbed, "tbh0") == [] and leftovers(testbed, "tbh1") == []


@pytest.mark.timeout(150)
def test_a_plain_torch_distributed_program_meets_across_the_hosts(testbed):
    """The testbed's hosts, like Debian's, resolve their own name to a loopback address, where
    torch's Gloo would bind and never meet the other host: each rank gets the launcher's
    routable interface as GLOO_SOCKET_IFNAME, unless its environment names one."""
    two = ["-np", "2", "-H", "tbh0:1,tbh1:1"]
    job = Job(testbed, "tbh0", two, "plain_torch_dist.py")
    assert job.finish(100) == 0, job.text()
    assert sorted(re.findall(r"PLAIN rank=(\d) sum=3 ifname=eth0", job.text())) == ["0", "1"], (
        job.text()
    )
    # a name the user gives wins; without torchrun's variables none is set
    job = Job(
        testbed,
        "tbh0",
        two + ["-x", "GLOO_SOCKET_IFNAME=lo"],
        "plain_torch_dist.py",
        ["--env-only"],
    )
    assert job.finish(60) == 0, job.text()
    assert len(re.findall(r"PLAIN rank=\d sum=- ifname=lo$", job.text(), re.M)) == 2, job.text()
    job = Job(testbed, "tbh0", two + ["--no-torch-env"], "plain_torch_dist.py", ["--env-only"])
    assert job.finish(60) == 0, job.text()
    assert len(re.findall(r"PLAIN rank=- sum=- ifname=-$", job.text(), re.M)) == 2, job.text()


@pytest.mark.timeout(150)
def test_ten_percent_loss_still_gives_the_right_values(testbed):
    testbed.lose("tbh1", 0.10)
    try:
        job = Job(testbed, "tbh0", HOSTS, "allreduce_steps.py", ["30", "20000"])
        assert job.finish(140) == 0, job.text()
    finally:
        testbed.stop_losing("tbh1")
    assert len(re.findall(r"SUMS_OK rank=\d", job.text())) == 4, job.text()


@pytest.mark.timeout(60)
def test_a_shaped_link_is_slow_and_a_cut_one_is_silent(testbed):
    """The testbed's own links: tbh1 shaped to 8 Mbit/s takes about a second to take 1 MB
    from tbh0; cut, nothing reaches it."""
    send = (
        "import socket,sys,time; s=socket.create_connection(('tbh1', 5001), 5); "
        "t=time.monotonic(); s.sendall(b'x'*1000000); s.shutdown(1); s.recv(1); "
        "print(time.monotonic()-t)"
    )
    recv = (
        "import socket; l=socket.socket(); l.setsockopt(socket.SOL_SOCKET, "
        "socket.SO_REUSEADDR, 1); l.bind(('0.0.0.0', 5001)); l.listen(); c,_=l.accept(); "
        "n=0\nwhile True:\n  b=c.recv(65536)\n  n+=len(b)\n  if not b: break\n"
        "c.sendall(b'k'); print(n)"
    )
    import subprocess
    import sys

    testbed.shape("tbh1", "8mbit", burst="32kb")
    try:
        server = testbed.popen(
            "tbh1", [sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.5)
        took = float(
            testbed.run(
                "tbh0", [sys.executable, "-c", send], capture_output=True, text=True, timeout_s=30
            ).stdout
        )
        assert server.communicate(timeout=10)[0].strip() == "1000000"
    finally:
        testbed.unshape("tbh1")
    assert 0.7 < took < 5, took  # 8 Mbit/s: 1 s for 1 MB
    testbed.cut("tbh1")
    try:
        probe = testbed.run(
            "tbh0",
            [sys.executable, "-c", "import socket; socket.create_connection(('tbh1', 22), 2)"],
            capture_output=True,
            text=True,
            timeout_s=20,
        )
        assert probe.returncode != 0 and "timed out" in probe.stderr, probe.stderr
    finally:
        testbed.heal("tbh1")


@pytest.mark.timeout(60)
def test_a_testbed_whose_owner_was_killed_is_swept(testbed):
    """``python -m tests.testbed up`` SIGKILLed: its namespaces and sshd stay until the next
    testbed (or ``sweep``) removes them."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from tests.testbed import sweep_stale
    from tests.testbed.hosts import _namespaces

    from .conftest import REPO

    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.testbed", "up", "--hosts", "1"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    described = json.loads(owner.stdout.readline())
    ns = described["hosts"][0]["namespace"]
    sshd_pids = [
        int(p)
        for p in subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True
        ).stdout.split()
    ]
    assert ns in _namespaces() and sshd_pids
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert ns in _namespaces()  # killed: nothing cleaned up
    swept = sweep_stale()
    assert ns in swept and described["switch"] in swept, swept
    assert ns not in _namespaces()
    for pid in sshd_pids:
        assert (
            not os.path.exists(f"/proc/{pid}/cmdline")
            or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )


@pytest.mark.timeout(120)
def test_a_cut_link_ends_the_job_naming_the_unreachable_host(testbed):
    """A static 2 x 2 job; tbh1's link is cut mid-allreduce.  The launcher (on tbh0) hears
    nothing more from tbh1's task service: within the op timeout it names tbh1 and its
    ranks (not the ranks on tbh0 that merely lost their peers) and ends; tbh1's task, which
    hears nothing from the launcher, ends its workers and its own SSH session, so nothing
    of the job is left on either host."""
    op_timeout = 20
    job = Job(
        testbed,
        "tbh0",
        HOSTS + ["--op-timeout-seconds", str(op_timeout)],
        "allreduce_steps.py",
        ["100000", "65536"],
    )
    try:
        job.wait_for("STEP 30 rank=3", 60)
        cut_at = time.monotonic()
        testbed.cut("tbh1")
        rc = job.finish(op_timeout + 30)
        took = time.monotonic() - cut_at
    finally:
        testbed.heal("tbh1")
    text = job.text()
    assert rc != 0 and took < op_timeout + 3, (rc, took, text)
    assert (
        "hvdlite-run: host tbh1 stopped answering: its task service has not replied for"
    ) in text, text
    assert "ranks 2, 3 on it are lost; the other ranks were terminated." in text, text
    assert "on host tbh0 exited" not in text and "on host tbh0 failed" not in text, text
    deadline = time.monotonic() + 25  # tbh1's task gives up on the silent launcher
    while (
        leftovers(testbed, "tbh1") or leftovers(testbed, "tbh0")
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftovers(testbed, "tbh0") == [] and leftovers(testbed, "tbh1") == [], (
        leftovers(testbed, "tbh0"),
        leftovers(testbed, "tbh1"),
    )


def _worker_pids(tb, host):
    return [pid for pid in tb.pids(host) if "elastic_train.py" in cmdline(pid)]


def _wait_for_nth(job, text, n, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hits = [at for at, line in job.lines if text in line]
        if len(hits) >= n:
            return hits[n - 1]
        if job.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} lines with {text!r}:\n{job.text()}")


@pytest.mark.timeout(120)
def test_a_frozen_rank_is_named_with_its_host_and_the_job_goes_on_when_it_resumes(
    testbed, tmp_path
):
    """A static job on tbh0 and tbh1; the rank on tbh1 is SIGSTOPped.  Its peer waits in a
    collective and can say nothing; the launcher, which sees the process stopped through
    tbh1's task service, names the rank and host within seconds.  SIGCONT: the job goes on
    and ends with the fault-free result."""
    import signal
    from tests.elastic.conftest import check_result

    slow = tmp_path / "slow"
    slow.write_text("")
    result = tmp_path / "result.json"
    job = Job(
        testbed,
        "tbh0",
        [
            "-np",
            "2",
            "-H",
            "tbh0:1,tbh1:1",
            "-x",
            "ELASTIC_STEPS",
            "-x",
            "ELASTIC_STEP_SLEEP",
            "-x",
            "ELASTIC_SLEEP_WHILE",
            "-x",
            "ELASTIC_OUT",
        ],
        os.path.join(ELASTIC_WORKERS, "elastic_train.py"),
        env={
            "ELASTIC_STEPS": "300",
            "ELASTIC_STEP_SLEEP": "0.1",
            "ELASTIC_SLEEP_WHILE": str(slow),
            "ELASTIC_OUT": str(result),
        },
    )
    job.wait_for("TRAIN rank=1 size=2 step=0", 60)
    time.sleep(1)
    (victim,) = _worker_pids(testbed, "tbh1")
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    named = job.wait_for("rank 1 on host tbh1 (worker tbh1:0) has been stopped for", 30)
    os.kill(victim, signal.SIGCONT)
    job.wait_for("rank 1 on host tbh1 (worker tbh1:0) runs again", 15)
    slow.unlink()
    assert job.finish(60) == 0, job.text()
    assert named - stopped_at < 12, (named - stopped_at, job.text())
    assert "every other rank waits for it in its next collective" in job.text()
    check_result(result, 300, [2])


@pytest.mark.slow  # the cut alone: test_a_cut_link_ends_the_job_naming_the_unreachable_host
@pytest.mark.timeout(180)
def test_elastic_job_survives_a_cut_and_the_host_rejoins_when_healed(testbed, tmp_path):
    """An elastic job on tbh0 and tbh1 (one slot each); tbh1's link is cut mid-training.
    The launcher hears nothing from tbh1 for 8 s, blacklists it and opens a round without
    it; the survivor, blocked in a collective with its vanished peer, lets go as soon as
    that round is open (not after --op-timeout-seconds) and resumes from its last commit.
    The link heals, tbh1's cooldown ends, a new task there starts a worker on standby while
    the survivor trains on; it joins at a commit and takes the state from the live peer.
    No split brain: the cut-off worker is never admitted again (the store knows its slot
    now belongs to the new process) and its task ends it.  Then the new worker on tbh1 is
    SIGSTOPped: the launcher ends it after 5 s and the survivor goes on again.  Every step
    runs once and the weights are the fault-free run's."""
    import signal
    from tests.elastic.conftest import check_result

    steps = 400
    slow = tmp_path / "slow"
    slow.write_text("")
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("tbh0:1\ntbh1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    result = tmp_path / "result.json"
    job = Job(
        testbed,
        "tbh0",
        [
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "2",
            "--host-discovery-script",
            str(discover),
            "--blacklist-cooldown-range",
            "8",
            "9",
            "-x",
            "ELASTIC_STEPS",
            "-x",
            "ELASTIC_STEP_SLEEP",
            "-x",
            "ELASTIC_SLEEP_WHILE",
            "-x",
            "ELASTIC_OUT",
        ],
        os.path.join(ELASTIC_WORKERS, "elastic_train.py"),
        env={
            "ELASTIC_STEPS": str(steps),
            "ELASTIC_STEP_SLEEP": "0.2",
            "ELASTIC_SLEEP_WHILE": str(slow),
            "ELASTIC_OUT": str(result),
        },
    )
    try:
        job.wait_for("TRAIN rank=1 size=2 step=0", 60)
        time.sleep(3)
        (cut_off,) = _worker_pids(testbed, "tbh1")
        testbed.cut("tbh1")
        cut_at = time.monotonic()
        released = job.wait_for("RESET rank=0 size=1", 30)
        time.sleep(2)
        testbed.heal("tbh1")
        _wait_for_nth(job, "RESET rank=0 size=2", 1, 60)  # tbh1 is back
        (new,) = [p for p in _worker_pids(testbed, "tbh1") if p != cut_off]
        time.sleep(1)
        os.kill(new, signal.SIGSTOP)
        _wait_for_nth(job, "RESET rank=0 size=1", 2, 30)
        slow.unlink()
        rc = job.finish(120)
    finally:
        testbed.heal("tbh1")
    text = job.text()
    assert rc == 0, text
    assert released - cut_at < 15, (released - cut_at, text)  # not the 60 s op timeout
    assert "host tbh1 stopped answering" in text and "blacklisting host tbh1" in text, text
    assert "gave up waiting for the Gloo" in text and "joining the new round" in text, text
    rejoined = text.split("blacklist cooldown over")[1]
    assert "starting 1 new worker ahead of the next round (tbh1:0)" in rejoined, text
    assert re.search(r"rank 1 tbh1:0 \(was on standby\)", rejoined), text
    assert "tbh1:0 stopped (SIGSTOP, a debugger or a frozen host) for 5s; ending them" in text, text
    assert "DONE rank=0" in text, text
    check_result(result, steps, [2, 1])
    assert not os.path.exists(f"/proc/{cut_off}/cmdline") and not os.path.exists(
        f"/proc/{new}/cmdline"
    )
    deadline = time.monotonic() + 20
    while (
        leftovers(testbed, "tbh1") or leftovers(testbed, "tbh0")
    ) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftovers(testbed, "tbh0") == [] and leftovers(testbed, "tbh1") == []
