"""Quick successive kills in an elastic job: no livelock, no step lost or repeated.

The hosts are four local names (``localhost``, ``127.0.0.1``, this machine's name
and one of its interface addresses): four single-slot hosts to the driver.  With
a blacklist cooldown on, a second kill while the round that replaces the first
victim is still forming used to strand the survivor in the out-of-date round for
the whole start timeout while every new worker timed out on it, got its host
blacklisted and triggered another round, for minutes.
"""

import json
import os
import random
import signal
import socket
import time

import psutil
import pytest

from tests import launching
from tests.elastic.conftest import check_result
from tests.elastic.test_elastic_launch import TRAIN, job_factory  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(240)


def _four_local_hosts():
    names = ["localhost", "127.0.0.1", socket.gethostname()]
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        extra = [i[4][0] for i in infos]
    except OSError:
        extra = []
    for iface_addrs in psutil.net_if_addrs().values():
        extra += [a.address for a in iface_addrs if a.family == socket.AF_INET]
    for addr in extra:
        if addr not in names and not addr.startswith("127."):
            names.append(addr)
            break
    return names[:4]


HOSTS = _four_local_hosts()


def _workers():
    """The live training processes, oldest first."""
    found = []
    for p in psutil.process_iter(["cmdline", "status", "create_time"]):
        try:
            cmd = p.info["cmdline"] or []
            if (
                p.info["status"] != psutil.STATUS_ZOMBIE
                and any(TRAIN in c for c in cmd)
                and launching.LAUNCHER[-1] not in cmd
            ):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sorted(found, key=lambda p: p.info["create_time"])


def _worker_of(host):
    """The live training process started for ``host`` (slot 0), or None."""
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if (
                p.info["status"] == psutil.STATUS_ZOMBIE
                or launching.LAUNCHER[-1] in cmd
                or not any(TRAIN in c for c in cmd)
            ):
                continue
            if p.environ().get("HVDLITE_HOSTNAME") == host:
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return None


def _kill(host):
    p = _worker_of(host)
    assert p is not None, f"no worker on {host}"
    os.kill(p.pid, signal.SIGKILL)


FLAGS = [
    "-np",
    "3",
    "--min-np",
    "2",
    "--max-np",
    "3",
    "--blacklist-cooldown-range",
    "10",
    "15",
    "--elastic-timeout",
    "60",
]


@pytest.mark.skipif(len(HOSTS) < 4, reason="needs four local host names")
def test_two_quick_kills_with_cooldown_finish_from_the_last_commit(job_factory):  # noqa: F811
    steps = 60
    job = job_factory(
        "".join(f"{h}:1\n" for h in HOSTS), FLAGS, env={"ELASTIC_STEP_SLEEP": "0.1"}, steps=steps
    )
    job.wait_for("TRAIN rank=2", timeout_s=60)
    time.sleep(1.0)
    started = time.monotonic()
    _kill(HOSTS[2])
    time.sleep(0.6)
    _kill(HOSTS[1])
    assert job.finish(timeout_s=120) == 0, job.output()
    took = time.monotonic() - started
    check_result(job.result, steps, sorted({2, 3}))
    assert took < 60, f"took {took:.0f}s after the kills:\n{job.output()}"


#: ten kills over two minutes are what the issue asks for; the suite runs fewer over a
#: shorter span to stay quick (KILL_TEST_COUNT=10 KILL_TEST_SPAN_S=120 runs the full case)
KILL_COUNT = int(os.environ.get("KILL_TEST_COUNT", "3"))
KILL_SPAN_S = float(os.environ.get("KILL_TEST_SPAN_S", "6"))


def _victims(job, timeout_s=60.0):
    """Every worker but the oldest, once there are at least two (a new one may be starting)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job.proc.poll() is None:
        victims = _workers()[1:]
        if victims:
            return victims
        time.sleep(0.1)
    return []


@pytest.mark.skipif(len(HOSTS) < 4, reason="needs four local host names")
@pytest.mark.slow  # kills in make test: test_two_quick_kills_... and test_chaos.py
@pytest.mark.timeout(KILL_SPAN_S + 200)
def test_random_kills_finish_from_the_last_commit(job_factory, tmp_path):  # noqa: F811
    """SIGKILLs of random workers at random moments (never the oldest one, which holds the
    only copy of the state while a round forms): no step is lost or repeated."""
    seed = int(os.environ.get("KILL_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    slow = tmp_path / "slow"
    slow.touch()
    # 0.5 s a step while the kills go on (more steps than they can last), full speed after
    steps = int(KILL_SPAN_S * 2.5 / 0.5) + 20
    job = job_factory(
        "".join(f"{h}:1\n" for h in HOSTS),
        FLAGS,
        steps=steps,
        env={"ELASTIC_STEP_SLEEP": "0.5", "ELASTIC_SLEEP_WHILE": str(slow)},
    )
    job.wait_for("TRAIN rank=2", timeout_s=60)
    kills = 0
    for _ in range(KILL_COUNT):
        time.sleep(rng.uniform(0.3, 1.7) * KILL_SPAN_S / KILL_COUNT)
        victims = _victims(job)
        if not victims:
            break
        os.kill(rng.choice(victims).pid, signal.SIGKILL)
        kills += 1
    slow.unlink()
    code = job.finish(timeout_s=150)
    assert code == 0, f"seed {seed}:\n{job.output()}"
    assert kills == KILL_COUNT, f"seed {seed}: only {kills} kills before the job ended"
    with open(job.result) as f:
        sizes = set(json.load(f)["sizes"])
    assert sizes <= {2, 3}, sizes
    check_result(job.result, steps, sorted(sizes))
