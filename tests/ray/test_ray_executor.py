"""hvdlite.ray.RayExecutor on real Ray clusters of this machine: an in-process cluster for the
simple cases, and two Ray nodes started with `ray start` on loopback so ranks span nodes."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (make install installs it)")

from hvdlite.ray import HvdliteRayError, RayExecutor  # noqa: E402
from tests.conftest import free_port, summary_names  # noqa: E402

REPO = Path(__file__).resolve().parent.parent.parent
BIN = Path(sys.executable).parent
#: a cluster of this test session only, on loopback: token authentication is not needed
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def local_cluster():
    os.environ.update(RAY_ENV)
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    yield
    ray.shutdown()


def _collectives(scale):
    import torch
    import hvdlite.torch as hvd

    hvd.init()
    value = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    gathered = hvd.allgather(torch.tensor([[hvd.rank()]])).flatten().tolist()
    out = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_size": hvd.cross_size(),
        "sum": value * scale,
        "gathered": gathered,
    }
    hvd.shutdown()
    return out


def _settings(**kw):
    return RayExecutor.create_settings(timeout_s=30, **kw)


@pytest.mark.timeout(120)
def test_run_collectives_in_rank_order(local_cluster):
    ex = RayExecutor(_settings(), num_workers=2, cpus_per_worker=1)
    ex.start()
    try:
        results = ex.run(_collectives, args=[10])
        assert [r["rank"] for r in results] == [0, 1]
        for r in results:
            assert (r["size"], r["local_size"], r["cross_size"]) == (2, 2, 1)
            assert r["sum"] == 30.0 and r["gathered"] == [0, 1]
        refs = ex.run_remote(_collectives, kwargs={"scale": 1})
        assert [r["sum"] for r in ray.get(refs)] == [3.0, 3.0]
    finally:
        ex.shutdown()


def _train(steps):
    """Two ranks on half batches, against one process on the full batches."""
    import torch
    import torch.nn as nn
    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def batches(member):
        g = torch.Generator().manual_seed(100 + member)
        return [
            (torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(steps)
        ]

    m = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters()
    )
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    for x, y in batches(hvd.rank()):
        opt.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for (xa, ya), (xb, yb) in zip(batches(0), batches(1)):
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(torch.cat([xa, xb])), torch.cat([ya, yb])).backward()
        ref_opt.step()
    diff = max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
    hvd.shutdown()
    return diff


@pytest.mark.timeout(120)
def test_distributed_optimizer_matches_one_process(local_cluster):
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start()
    try:
        assert max(ex.run(_train, args=[5])) < 1e-6
    finally:
        ex.shutdown()


class Counter:
    """An executable_cls: state that lives in the actor across execute() calls."""

    def __init__(self, start, step=1):
        self.value = start
        self.step = step

    def bump(self):
        self.value += self.step
        return self.value


@pytest.mark.timeout(120)
def test_executable_cls_keeps_state(local_cluster):
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start(
        executable_cls=Counter,
        executable_args=[5],
        executable_kwargs={"step": 2},
        extra_env_vars={"MY_SETTING": "on"},
    )
    try:
        assert ex.execute(lambda c: c.bump()) == [7, 7]
        assert ex.execute(lambda c: c.bump()) == [9, 9]
        assert ex.execute_single(lambda c: (c.value, os.environ["MY_SETTING"])) == (9, "on")
    finally:
        ex.shutdown()


def _fails_on_rank_one():
    import torch
    import hvdlite.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one gives up on purpose")
    hvd.allreduce(torch.ones(1))  # rank 0 waits for a peer that is gone
    return "unreachable"


def _rank_worker_pids():
    return {
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any("RankWorker" in part for part in (p.info["cmdline"] or []))
    }


@pytest.mark.timeout(120)
def test_a_failing_rank_is_named_and_the_others_end(local_cluster, capfd):
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start()
    actors = list(ex.workers)
    with pytest.raises(HvdliteRayError) as info:
        ex.run(_fails_on_rank_one)
    msg = str(info.value)
    node = ray.nodes()[0]["NodeManagerAddress"]
    assert f"rank 1 on node {node}" in msg and "rank one gives up on purpose" in msg, msg
    assert "ValueError" in msg
    # the job ran through run_job: the same failure summary as hvdlite-run's, on stderr
    err = capfd.readouterr().err
    assert summary_names(err, 1, "ValueError: rank one gives up on purpose", node), err
    for actor in actors:  # torn down, not left waiting
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=30)
    with pytest.raises(HvdliteRayError, match="not started"):
        ex.run(_collectives, args=[1])
    ex.shutdown()


@pytest.mark.timeout(120)
def test_too_many_cpus_fail_within_the_placement_timeout(local_cluster):
    ex = RayExecutor(_settings(placement_group_timeout_s=3), num_workers=8, cpus_per_worker=1)
    start = time.monotonic()
    with pytest.raises(HvdliteRayError) as info:
        ex.start()
    assert time.monotonic() - start < 30
    assert "could not place 8 workers" in str(info.value) and "3 CPUs" in str(info.value)
    # the reservation is gone: a job that fits still starts
    ok = RayExecutor(_settings(), num_workers=2)
    ok.start()
    try:
        assert [r["sum"] for r in ok.run(_collectives, args=[1])] == [3.0, 3.0]
    finally:
        ok.shutdown()


@pytest.mark.timeout(120)
def test_shutdown_leaves_no_rank_actor(local_cluster):
    before = _rank_worker_pids()
    ex = RayExecutor(_settings(), num_workers=2)
    ex.start()
    pids = {ray.get(w.ping.remote()) for w in ex.workers}
    ex.shutdown()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert _rank_worker_pids() <= before


def test_bad_arguments_are_refused_at_once():
    with pytest.raises(ValueError, match="either num_workers"):
        RayExecutor(_settings(), num_workers=2, num_hosts=2)
    with pytest.raises(ValueError, match="drop num_hosts"):
        RayExecutor(_settings(), num_hosts=2, min_workers=1)
    with pytest.raises(ValueError, match="positive"):
        RayExecutor.create_settings(timeout_s=0)


# -- two Ray nodes ---------------------------------------------------------------------------

TWO_NODE_DRIVER = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
from hvdlite.ray import RayExecutor
from tests.ray.test_ray_executor import _collectives
ex = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2, num_workers_per_host=2)
ex.start()
for r in ex.run(_collectives, args=[1]):
    print("RESULT " + json.dumps(r), flush=True)
ex.shutdown()
"""


def _ray(*args, env, timeout=120):
    return subprocess.run(
        [str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(240)
def test_two_nodes_number_ranks_node_by_node():
    port = free_port()
    env = dict(os.environ, **RAY_ENV, PYTHONPATH=str(REPO))
    # Ray's socket paths must stay under 108 bytes: a short directory of our own
    temp = tempfile.mkdtemp(prefix="hvr", dir="/tmp")
    common = ["--num-cpus", "2", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    head = _ray(
        "start",
        "--head",
        "--port",
        str(port),
        "--include-dashboard=false",
        "--temp-dir",
        temp,
        *common,
        env=env,
    )
    try:
        assert head.returncode == 0, head.stdout + head.stderr
        second = _ray("start", "--address", f"127.0.0.1:{port}", *common, env=env)
        assert second.returncode == 0, second.stdout + second.stderr
        proc = subprocess.run(
            [sys.executable, "-c", TWO_NODE_DRIVER, f"127.0.0.1:{port}"],
            env=env,
            cwd=str(REPO),
            capture_output=True,
            text=True,
            timeout=180,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        results = [
            json.loads(line[len("RESULT ") :])
            for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")
        ]
        assert [r["rank"] for r in results] == [0, 1, 2, 3], out[-3000:]
        for r in results:
            assert (r["size"], r["local_size"], r["cross_size"]) == (4, 2, 2), r
            assert r["sum"] == 10.0 and r["gathered"] == [0, 1, 2, 3]
        assert [r["local_rank"] for r in results] == [0, 1, 0, 1]
    finally:
        _stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _stop_cluster(temp):
    """End this test's Ray nodes only (``ray stop`` would end every Ray on the machine,
    this module's in-process cluster included): the processes that name its directory,
    and their children."""
    roots = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any(temp in part for part in (p.info["cmdline"] or []))
    ]
    procs = set(roots)
    for p in roots:
        try:
            procs.update(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    # some of Ray's processes never end on SIGTERM: a short grace, then SIGKILL
    _, alive = psutil.wait_procs(list(procs), timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    assert not [p for p in procs if p.is_running() and p.status() != "zombie"]


@pytest.mark.timeout(180)
def test_example_trains(local_cluster):
    """The example as a driver of the module's cluster (its --address), not a Ray of its own."""
    env = dict(os.environ, **RAY_ENV, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "ray_pytorch_train.py"),
            "--epochs",
            "40",
            "--address",
            ray.get_runtime_context().gcs_address,
        ],
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=170,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    first = float(out.split("FIRST_LOSS ")[1].split()[0])
    last = float(out.split("FINAL_LOSS ")[1].split()[0])
    assert last < 0.5 * first, (first, last)
