"""Elastic jobs on Ray (RayExecutor with min_workers / max_workers) on real `ray start` nodes
of this machine: a killed worker's node leaves and training completes from the last commit;
a node that joins mid-run grows the world.  Both end at the one-process reference weights."""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

pytest.importorskip("ray", reason="ray is not installed (make install installs it)")

from tests.elastic.workers.elastic_train import reference  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.ray.test_ray_executor import REPO, RAY_ENV, _ray, _stop_cluster  # noqa: E402

DRIVER = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
from hvdlite.ray import RayExecutor
from tests.ray.elastic_fn import train
ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=2, max_workers=4,
                 elastic_timeout=60)
ex.start()
kwargs = json.loads(sys.argv[2])
if kwargs.pop("kill_other_node", False):
    me = ray.get_runtime_context().get_node_id()
    other = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != me][0]
    kwargs["kill_at"] = [other["NodeManagerAddress"] + "-" + other["NodeID"][:8], 1, 5]
print("STARTED", flush=True)
for r in ex.run(train, kwargs=kwargs):
    print("RESULT " + json.dumps(r), flush=True)
ex.shutdown()
"""
COMMON = ["--num-cpus", "2", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]


class Cluster:
    """Ray nodes of this test only (stopped by killing its own processes)."""

    def __init__(self):
        self.port = free_port()
        self.env = dict(os.environ, **RAY_ENV, PYTHONPATH=str(REPO))
        self.temp = tempfile.mkdtemp(prefix="hvr", dir="/tmp")
        r = _ray(
            "start",
            "--head",
            "--port",
            str(self.port),
            "--include-dashboard=false",
            "--temp-dir",
            self.temp,
            *COMMON,
            env=self.env,
        )
        assert r.returncode == 0, r.stdout + r.stderr

    def add_node(self):
        r = _ray("start", "--address", f"127.0.0.1:{self.port}", *COMMON, env=self.env)
        assert r.returncode == 0, r.stdout + r.stderr

    def run(self, kwargs, when_started=None, timeout=200):
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, f"127.0.0.1:{self.port}", json.dumps(kwargs)],
            env=self.env,
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines = []

        def read():
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("STARTED") and when_started is not None:
                    threading.Thread(target=when_started, daemon=True).start()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(10)
        out = "".join(lines)
        assert proc.returncode == 0, out[-4000:]
        results = [json.loads(x[len("RESULT ") :]) for x in lines if x.startswith("RESULT ")]
        return results, out

    def stop(self):
        _stop_cluster(self.temp)


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.stop()


def _assert_reference(results, steps):
    weight, bias = reference(steps)
    for r in results:
        assert r["history"] == list(range(steps)), r["history"]  # no step lost or repeated
        assert max(abs(a - b) for a, b in zip(r["weight"], weight)) < 1e-5, (r["weight"], weight)
        assert abs(r["bias"][0] - bias[0]) < 1e-5


@pytest.mark.timeout(240)
def test_a_killed_worker_leaves_and_training_completes(cluster):
    cluster.add_node()
    results, out = cluster.run({"steps": 20, "kill_other_node": True})
    # only the dead worker's slot leaves: its node mate keeps its actor and its state
    assert "exited with code 137" in out and "blacklisting slot" in out, out[-4000:]
    assert [r["rank"] for r in results] == [0, 1, 2] and {r["size"] for r in results} == {3}
    sizes = results[0]["sizes"]
    assert sizes[0] == 4 and sizes[-1] == 3, sizes
    _assert_reference(results, 20)


@pytest.mark.slow  # a Ray job that changes size in make test: test_a_killed_worker_leaves_...
@pytest.mark.timeout(240)
def test_a_node_that_joins_grows_the_world(cluster):
    trained = os.path.join(cluster.temp, "trained")

    def add_later():  # once a step at the first size is done
        deadline = time.monotonic() + 120
        while not os.path.exists(trained) and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.add_node()

    # up to 30 s of slow steps for the node to join; once the world has 4 the rest run at once
    results, out = cluster.run(
        {"steps": 120, "sleep_s": 0.25, "sleep_below_size": 4, "trained_file": trained},
        when_started=add_later,
    )
    assert [r["rank"] for r in results] == [0, 1, 2, 3], out[-4000:]
    sizes = results[0]["sizes"]
    assert sizes[0] == 2 and sizes[-1] == 4, sizes
    _assert_reference(results, 120)
