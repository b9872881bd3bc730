"""A stranger without the key cannot stop a job from starting: real jobs under 1,000 idle
connections per listener (each reopened as soon as it is closed), and under junk frames.

The attacker (``workers/flood.py``) runs in its own process and finds the launcher's
listeners (rendezvous store, driver) and the task services' by looking at the processes;
the ranks (``workers/flood_worker.py``) call ``init()`` only once the attack is on.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
import time

import pytest

from tests import launching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "hardening", "workers")
FLOOD = os.path.join(WORKERS, "flood.py")
RANK = os.path.join(WORKERS, "flood_worker.py")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)


def _env():
    return dict(
        os.environ,
        PYTHONPATH=ROOT,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
    )


def _attacked_job(tmp_path, hosts=(), conns=1000, fuzz_seed=None, steps=3, seconds=40):
    """Run ``hvdlite-run -np 2`` under attack; return (launcher result, attacker stats, s)."""
    ready = str(tmp_path / "attack-on")
    t0 = time.monotonic()
    job = launching.start(
        ["-np", "2", *hosts, "--start-timeout", "30", sys.executable, RANK, ready, steps],
        pythonpath=[ROOT],
        cwd=str(tmp_path),
    )
    fuzz = ["--fuzz", str(fuzz_seed)] if fuzz_seed is not None else []
    attacker = subprocess.Popen(
        [
            sys.executable,
            FLOOD,
            "--pid",
            str(job.pid),
            "--cwd",
            os.path.realpath(str(tmp_path)),
            "--ready",
            ready,
            "--seconds",
            str(seconds),
            "--conns",
            str(conns),
            *fuzz,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    try:
        out, err = job.communicate(timeout=seconds + 20)
        took = time.monotonic() - t0
        a_out, a_err = attacker.communicate(timeout=30)
    finally:
        for p in (job, attacker):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert attacker.returncode == 0, a_err
    stats = json.loads(a_out.strip().splitlines()[-1])
    launcher = stats.pop("launcher")
    print(
        f"launcher under attack (first, highest): descriptors {launcher['fds_first']}, "
        f"{launcher['fds_max']}; threads {launcher['threads_first']}, "
        f"{launcher['threads_max']}; RSS MiB {launcher['rss_mib_first']}, "
        f"{launcher['rss_mib_max']}"
    )
    # bounded: two listeners' waiting tables (512 each) plus the job's own; a few threads
    assert launcher["fds_max"] < 2 * 512 + 200, launcher
    assert launcher["threads_max"] < 60, launcher
    return subprocess.CompletedProcess(job.args, job.returncode, out, err), stats, took


def _check_job(r, stats, took, listeners, conns):
    assert r.returncode == 0, f"exit {r.returncode} after {took:.1f}s\n{r.stdout}\n{r.stderr}"
    oks = sorted(ln.split(":", 1)[1] for ln in r.stdout.splitlines() if "OK rank=" in ln)
    assert oks == ["OK rank=0 size=2 sum=3.0", "OK rank=1 size=2 sum=3.0"], r.stdout
    assert len(stats) >= listeners, f"attacked only {sorted(stats)}: {stats}"
    for port, s in stats.items():
        assert s.get("opened", 0) >= conns, (port, s)
        assert s.get("answered_bytes", 0) == 0, f"listener {port} answered junk: {s}"
    assert r.stderr.count("\n") < 80, r.stderr[-3000:]  # rejections stay summarised


@pytest.mark.timeout(90)
def test_a_local_job_starts_while_1000_idle_connections_hold_the_store(tmp_path):
    r, stats, took = _attacked_job(tmp_path)
    print(f"job under attack: {took:.1f}s; attacker: {stats}")
    _check_job(r, stats, took, listeners=1, conns=1000)


@pytest.mark.timeout(120)
def test_a_two_host_job_starts_while_1000_idle_connections_hold_each_listener(tmp_path, sshd):
    """Driver, store and both task services (127.0.0.1 local, 127.0.0.2 over SSH)."""
    r, stats, took = _attacked_job(tmp_path, ["-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args()])
    print(f"job under attack: {took:.1f}s; attacker: {stats}")
    _check_job(r, stats, took, listeners=4, conns=1000)


@pytest.mark.timeout(120)
def test_junk_frames_against_every_listener_while_a_job_runs(tmp_path, sshd):
    """Random, truncated, oversized, bit-flipped frames, huge lengths, and (with the key an
    eavesdropper would not have, read from a rank's environment) hellos and requests signed
    for other connections: none is answered, the job finishes with the right sums."""
    seed = int(os.environ.get("HVD_FLOOD_SEED", random.randrange(1 << 30)))
    print(f"fuzz seed {seed} (HVD_FLOOD_SEED={seed} repeats it)")
    r, stats, took = _attacked_job(
        tmp_path,
        ["-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args()],
        conns=16,
        fuzz_seed=seed,
        steps=40,
    )
    print(f"job under fuzz: {took:.1f}s; attacker: {stats}")
    try:
        _check_job(r, stats, took, listeners=4, conns=16)
        sent = sum(v for s in stats.values() for k, v in s.items() if k.startswith("sent_"))
        assert sent >= 200, stats
        replayed = sum(
            s.get("sent_replayed_hello", 0) + s.get("sent_hello_then_replay", 0)
            for s in stats.values()
        )
        assert replayed >= 20, f"the key was not found, so nothing was replayed: {stats}"
    except AssertionError as exc:
        raise AssertionError(f"fuzz seed {seed}: {exc}") from None
