"""End-to-end launches through the real hvdlite-run: local and over a real sshd."""

import importlib.util
import re
import signal
import subprocess
import threading
import time
import uuid

import psutil
import pytest

from conftest import procs_with, run_launcher, wait_gone, worker

from tests import launching

KV = worker("kv_worker.py")
ANY_TASK = "hvdlite.runner.tasks.task_service"


def ok_lines(out):
    return sorted(re.findall(r"^\[(\d+)\]<stdout>:OK (.*)$", out, re.M))


def fields(line):
    return dict(kv.split("=", 1) for kv in line.split())


@pytest.mark.timeout(60)
def test_local_ranks_output_and_files(tmp_path):
    out_dir = tmp_path / "out"
    r = run_launcher(
        [
            "-np",
            "3",
            "-H",
            "localhost:2,127.0.0.1:1",
            "--output-filename",
            str(out_dir),
            "--prefix-output-with-timestamp",
            KV,
        ]
    )
    assert r.returncode == 0, r.stderr
    got = {
        int(rank): fields(rest)
        for rank, rest in ok_lines(
            re.sub(r"^\w{3} \w{3} \d\d \d\d:\d\d:\d\d \d{4}", "", r.stdout, flags=re.M)
        )
    }
    assert got[0]["local"] == "0/2" and got[1]["local"] == "1/2" and got[2]["local"] == "0/1"
    assert got[2]["cross"] == "1/2" and got[1]["cross"] == "0/1"
    assert re.search(r"^\w{3} \w{3} \d\d \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:OK", r.stdout, re.M)
    for rank in range(3):
        assert "OK rank=%d" % rank in (out_dir / f"rank.{rank}" / "stdout").read_text()
        assert "to stderr from %d" % rank in (out_dir / f"rank.{rank}" / "stderr").read_text()


@pytest.mark.timeout(60)
def test_local_failure_names_rank_and_kills_others():
    tag = uuid.uuid4().hex
    r = run_launcher(
        ["-np", "2", KV, "--fail-rank", "1", "--code", "3", "--sleep", "60", "--tag", tag]
    )
    assert r.returncode == 3
    assert "rank 1 on host localhost exited with code 3" in r.stderr
    assert wait_gone(tag, 5) == []


def _start_and_interrupt(args, tag, n_ready, while_running=None):
    """Start hvdlite-run, wait for ``n_ready`` READY lines, call ``while_running(launcher)``
    (if given, with the launcher's Popen), then SIGINT it and check that every worker is
    gone; returns its stderr."""
    proc = launching.start(args, start_new_session=True)
    ready = set()
    lines = []
    done = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"\[(\d+)\]<stdout>:READY", line)
            if m:
                ready.add(m.group(1))
                if len(ready) == n_ready:
                    done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(40):
        proc.kill()
        pytest.fail(f"ranks never got ready: {lines} {proc.stderr.read()}")
    assert len(procs_with(tag)) >= n_ready
    if while_running is not None:
        while_running(proc)
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("hvdlite-run did not exit within 10s of SIGINT")
    took = time.monotonic() - t
    left = wait_gone(tag, max(0.5, 10 - took))
    assert left == [], f"workers survived SIGINT: {[p.pid for p in left]}"
    assert code != 0
    return proc.stderr.read()


@pytest.mark.timeout(60)
def test_local_sigint_ends_all_workers():
    tag = uuid.uuid4().hex
    err = _start_and_interrupt(["-np", "2", KV, "--sleep", "120", "--tag", tag], tag, 2)
    assert "received SIGINT" in err


# ---------------------------------------------------------------- over SSH


@pytest.mark.timeout(90)
def test_ssh_two_hosts_end_to_end(sshd, monkeypatch):
    monkeypatch.setenv("FWD_ME", "from-launcher")
    monkeypatch.setenv("NOT_FORWARDED_SECRET", "x")
    r = run_launcher(
        [
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            *sshd.ssh_args(),
            "-x",
            "FWD_ME",
            "-x",
            "SET_X=42",
            "--cycle-time-ms",
            "3",
            KV,
            "--print-env",
            "FWD_ME,SET_X,NOT_FORWARDED_SECRET,HVDLITE_CYCLE_TIME",
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = {int(rank): fields(rest) for rank, rest in ok_lines(r.stdout)}
    assert got[0]["host"] == "127.0.0.1" and got[1]["host"] == "127.0.0.2"
    for rank in (0, 1):
        assert got[rank]["size"] == "2" and got[rank]["local"] == "0/1"
        assert got[rank]["cross"] == f"{rank}/2"
        assert got[rank]["peers"] == "127.0.0.1,127.0.0.2"
        assert got[rank]["iface"] and got[rank]["rdv"] != "127.0.0.1" or got[rank]["iface"] == "lo"
    remote_env = re.findall(r"^\[1\]<stdout>:ENV (.*)$", r.stdout, re.M)
    assert "FWD_ME=from-launcher" in remote_env and "SET_X=42" in remote_env
    assert "NOT_FORWARDED_SECRET=<unset>" in remote_env
    assert "HVDLITE_CYCLE_TIME=3.0" in remote_env
    assert "2/2 tasks registered" in r.stderr and "2 workers started" in r.stderr
    assert wait_gone(ANY_TASK, 5) == []


@pytest.mark.timeout(90)
def test_launcher_agent_starts_the_remote_task_instead_of_ssh(tmp_path):
    """``--launcher-agent CMD`` runs ``CMD HOST COMMAND`` for a remote host (here a script
    that runs the command on this machine, as a kubectl exec wrapper would in a pod)."""
    calls = tmp_path / "agent.log"
    agent = tmp_path / "agent.sh"
    agent.write_text(f'#!/bin/sh\necho "$1" >> {calls}\nexec sh -c "$2"\n')
    agent.chmod(0o755)
    r = run_launcher(
        ["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", "--launcher-agent", f"{agent}", KV]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = {int(rank): fields(rest) for rank, rest in ok_lines(r.stdout)}
    assert got[0]["host"] == "127.0.0.1" and got[1]["host"] == "127.0.0.2"
    assert calls.read_text().split() == ["127.0.0.2"]  # the local host needs no agent
    assert wait_gone(ANY_TASK, 5) == []
    bad = run_launcher(
        [
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            "--launcher-agent",
            str(tmp_path / "missing-agent"),
            KV,
        ]
    )
    assert bad.returncode != 0 and "--launcher-agent" in bad.stderr, bad.stderr


def test_mpijob_hostfile_from_the_environment(tmp_path):
    """No -H/--hostfile: the hostfile Kubeflow's MPIJob names in OMPI_MCA_orte_default_hostfile
    (here two local names, so two hosts without SSH)."""
    hf = tmp_path / "hostfile"
    hf.write_text("localhost:1\n127.0.0.1:1\n")
    r = run_launcher(["-np", "2", KV], env={"OMPI_MCA_orte_default_hostfile": str(hf)})
    assert r.returncode == 0, r.stdout + r.stderr
    got = {int(rank): fields(rest) for rank, rest in ok_lines(r.stdout)}
    assert [got[i]["host"] for i in range(2)] == ["localhost", "127.0.0.1"]
    assert got[1]["cross"] == "1/2"


@pytest.mark.timeout(90)
def test_ssh_hostfile_strict_known_hosts_and_nic(sshd, tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("# two slots on the 'remote' host\n127.0.0.2 slots=2\n\n127.0.0.1 slots=1\n")
    r = run_launcher(
        [
            "-np",
            "3",
            "--hostfile",
            str(hf),
            "--ssh-port",
            str(sshd.port),
            "--ssh-identity-file",
            sshd.identity,
            "--ssh-known-hosts",
            sshd.known_hosts,
            "--ssh-strict-host-key-checking",
            "--network-interfaces",
            "lo",
            "--verbose",
            KV,
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = {int(rank): fields(rest) for rank, rest in ok_lines(r.stdout)}
    assert [got[i]["host"] for i in range(3)] == ["127.0.0.2", "127.0.0.2", "127.0.0.1"]
    assert got[1]["local"] == "1/2" and got[2]["cross"] == "1/2"
    assert all(g["iface"] == "lo" and g["rdv"] == "127.0.0.1" for g in got.values())
    assert "reaches" in r.stderr  # --verbose tells the probe results


@pytest.mark.timeout(60)
def test_ssh_unknown_host_key_rejected_when_strict(sshd, tmp_path):
    empty = tmp_path / "known"
    empty.write_text("")
    r = run_launcher(
        [
            "-np",
            "1",
            "-H",
            "127.0.0.2:1",
            *sshd.ssh_args(),
            "--ssh-known-hosts",
            str(empty),
            "--ssh-strict-host-key-checking",
            KV,
        ],
        timeout=30,
    )
    assert r.returncode != 0 and "127.0.0.2" in r.stderr and "known" in r.stderr


@pytest.mark.timeout(60)
def test_ssh_wrong_key_names_host(sshd):
    t = time.monotonic()
    r = run_launcher(
        [
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            "-p",
            str(sshd.port),
            "-i",
            sshd.wrong_identity,
            KV,
        ],
        timeout=30,
    )
    assert r.returncode != 0
    assert f"SSH to 127.0.0.2:{sshd.port}: authentication" in r.stderr, r.stderr
    assert "-i/--ssh-identity-file" in r.stderr
    assert time.monotonic() - t < 20
    assert wait_gone(ANY_TASK, 5) == []


@pytest.mark.timeout(60)
def test_ssh_bad_network_interface(sshd):
    r = run_launcher(
        [
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            *sshd.ssh_args(),
            "--network-interfaces",
            "nosuch0",
            KV,
        ],
        timeout=40,
    )
    assert r.returncode != 0 and "--network-interfaces nosuch0" in r.stderr, r.stderr
    assert wait_gone(ANY_TASK, 5) == []


@pytest.mark.timeout(90)
def test_ssh_failure_propagates_no_orphans(sshd):
    tag = uuid.uuid4().hex
    t = time.monotonic()
    # rank 1 (remote) exits 3 while ranks 0 and 2 sleep for two minutes
    r = run_launcher(
        [
            "-np",
            "3",
            "-H",
            "127.0.0.1:1,127.0.0.2:2",
            *sshd.ssh_args(),
            KV,
            "--fail-rank",
            "1",
            "--code",
            "3",
            "--sleep",
            "120",
            "--tag",
            tag,
        ],
        timeout=60,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "rank 1 on host 127.0.0.2 exited with code 3" in r.stderr
    assert time.monotonic() - t < 30
    assert wait_gone(tag, 5) == [], "a worker survived the failure"
    assert wait_gone(ANY_TASK, 5) == [], "a task survived the failure"


@pytest.mark.timeout(90)
def test_ssh_sigint_ends_everything(sshd):
    tag = uuid.uuid4().hex
    # while the job runs, the job key's variable is on none of its command lines (the key
    # travels on the SSH channel's stdin): the launcher's, or those of the tasks and workers
    # that this test's sshd started
    seen = []
    err = _start_and_interrupt(
        [
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            *sshd.ssh_args(),
            KV,
            "--sleep",
            "120",
            "--tag",
            tag,
        ],
        tag,
        2,
        while_running=lambda launcher: seen.extend(_command_lines(launcher.pid, sshd.proc.pid)),
    )
    assert "received SIGINT" in err
    assert wait_gone(ANY_TASK, 5) == []
    assert any(ANY_TASK in line for _, line in seen), seen  # the tasks were looked at
    leaked = [f"pid {pid}: {line}" for pid, line in seen if "HVDLITE_SECRET_KEY" in line]
    assert not leaked, f"the job key's variable on a command line: {leaked}"


def _command_lines(*roots):
    """``(pid, command line)`` of ``roots`` and all their descendants; processes that exit
    while we look are skipped."""
    found = []
    for root in roots:
        try:
            top = psutil.Process(root)
            family = [top] + top.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in family:
            try:
                found.append((p.pid, " ".join(p.cmdline())))
            except psutil.NoSuchProcess:  # exited (or a zombie) since it was listed
                continue
    return found


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_ssh_trains_with_the_runtime(sshd):
    r = run_launcher(
        ["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args(), worker("torch_worker.py")],
        timeout=100,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(re.findall(r"^\[(\d)\]<stdout>:TRAINOK rank=(\d) size=2", r.stdout, re.M)) == [
        ("0", "0"),
        ("1", "1"),
    ]


@pytest.mark.timeout(60)
def test_math_threads_split_between_local_ranks_unless_set():
    import os

    r = launching.run(
        ["-np", "2", KV, "--print-env", "OMP_NUM_THREADS"], timeout=50, unset=["OMP_NUM_THREADS"]
    )
    assert r.returncode == 0, r.stderr
    expect = max(1, (os.cpu_count() or 1) // 2)
    assert r.stdout.count(f"ENV OMP_NUM_THREADS={expect}") == 2, r.stdout
    r = run_launcher(
        ["-np", "2", KV, "--print-env", "OMP_NUM_THREADS"], env={"OMP_NUM_THREADS": "7"}
    )
    assert r.stdout.count("ENV OMP_NUM_THREADS=7") == 2, r.stdout
