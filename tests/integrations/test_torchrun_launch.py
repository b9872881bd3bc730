"""A Horovod-style script (hvdlite.torch) started by the real torchrun, as on a PyTorchJob or
any platform that starts ranks with torchrun's variables: init() meets the other ranks at
torch's store and training reaches the weights it reaches under hvdlite-run (and those of
one process on whole batches); one node or two; a missing peer ends in an error that names
it; HVDLITE_REFUSE_TORCHRUN brings back the refusal."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests import launching
from tests.conftest import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
SCRIPT = os.path.join(WORKERS, "horovod_style.py")
sys.path.insert(0, WORKERS)
import horovod_style  # noqa: E402  (the one-process reference)

pytestmark = pytest.mark.timeout(180)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDLITE_", "HOROVOD_"))}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _torchrun(*args, env=None, timeout=150):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args, SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or _env(),
        cwd=REPO,
    )


def _finish(proc, timeout=150):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError("torchrun did not finish:\n" + out[-4000:])
    return proc.returncode, out


def _weights(out: str):
    return [json.loads(w) for w in re.findall(r"WEIGHTS (\[.*\])$", out, re.M)]


def _places(out: str):
    return sorted(
        tuple(int(v) for v in re.findall(r"=(\d+)", line))
        for line in re.findall(r"PLACE (.*)$", out, re.M)
    )


def _close(a, b, tol):
    return all(abs(x - y) <= tol for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.fixture(scope="module")
def reference():
    return horovod_style.train(0, 1)


def test_torchrun_standalone_reaches_the_weights_of_hvdlite_run(reference):
    code, out = _finish(_torchrun("--standalone", "--nproc-per-node", "2"))
    assert code == 0, out[-4000:]
    # rank, size, local_rank, local_size, cross_rank, cross_size as torchrun placed them
    assert _places(out) == [(0, 2, 0, 2, 0, 1), (1, 2, 1, 2, 0, 1)], out[-3000:]
    assert re.findall(r"OBJECT (.*)$", out, re.M) == ['{"from": 0, "argv": []}'] * 2, out
    under_torchrun = _weights(out)
    assert len(under_torchrun) == 2 and under_torchrun[0] == under_torchrun[1]

    r = launching.run(
        ["-np", "2", sys.executable, SCRIPT],
        timeout=150,
        env={"OMP_NUM_THREADS": "1"},
        pythonpath=[REPO],
        unset=[k for k in os.environ if k.startswith(("HVDLITE_", "HOROVOD_"))]
        + ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"],
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    under_hvdlite_run = _weights(r.stdout)
    assert len(under_hvdlite_run) == 2
    assert _close(under_torchrun[0], under_hvdlite_run[0], 1e-6)
    assert _close(under_torchrun[0], reference, 1e-5)  # averaged: the whole batches


def test_two_torchrun_nodes_meet_through_node_zeros_store(reference):
    port = free_port()
    nodes = [
        _torchrun(
            "--nnodes",
            "2",
            "--node-rank",
            str(n),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        )
        for n in (0, 1)
    ]
    results = [_finish(p) for p in nodes]
    out = "\n".join(o for _, o in results)
    assert [c for c, _ in results] == [0, 0], out[-4000:]
    assert _places(out) == [(r, 4, r % 2, 2, r // 2, 2) for r in range(4)], out[-3000:]
    weights = _weights(out)
    assert len(weights) == 4 and all(w == weights[0] for w in weights)
    assert _close(weights[0], reference, 1e-5)


def _one_rank(tmp_path, **env):
    """rank 0 of 2, alone, with torch's store where ``env`` says (no agent: it serves it)."""
    script = tmp_path / "init_only.py"
    script.write_text("import hvdlite.torch as hvd\nhvd.init()\nprint('INIT DONE')\n")
    base = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "HVDLITE_START_TIMEOUT": "3",
    }
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(**dict(base, **env)),
        cwd=str(tmp_path),
    )


def test_a_peer_that_never_comes_is_named_within_the_start_timeout(tmp_path):
    r = _one_rank(tmp_path)
    assert r.returncode != 0 and "INIT DONE" not in r.stdout
    assert "ranks [1] did not reach hvd.init() within 3s" in r.stderr, r.stderr[-2000:]


def test_an_unreachable_store_is_named(tmp_path):
    r = _one_rank(tmp_path, RANK="1", LOCAL_RANK="1", TORCHELASTIC_USE_AGENT_STORE="True")
    assert r.returncode != 0 and "INIT DONE" not in r.stdout
    assert "cannot reach torch's store at 127.0.0.1:" in r.stderr, r.stderr[-2000:]
    assert "(MASTER_ADDR:MASTER_PORT) within 3s" in r.stderr


def test_the_old_refusal_is_a_variable_away():
    env = _env(HVDLITE_REFUSE_TORCHRUN="1")
    code, out = _finish(_torchrun("--standalone", "--nproc-per-node", "2", env=env))
    assert code != 0 and "WEIGHTS" not in out
    assert "HVDLITE_REFUSE_TORCHRUN refuses such starts" in out, out[-3000:]
    assert "hvdlite-run -np 2" in out


TF_SCRIPT = """
import os
import tensorflow as tf
import hvdlite.tensorflow as hvd
hvd.init()
total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum)
assert hvd.DistributedGradientTape is not None
os.write(1, f"TF rank={hvd.rank()} size={hvd.size()} total={total.numpy().tolist()}\\n".encode())
"""


@pytest.mark.slow
def test_a_tensorflow_script_under_torchrun(tmp_path):
    pytest.importorskip("tensorflow")
    script = tmp_path / "tf_train.py"
    script.write_text(TF_SCRIPT)
    env = _env(TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(tmp_path),
    )
    code, out = _finish(proc)
    assert code == 0, out[-4000:]
    assert sorted(re.findall(r"^TF (.*)$", out, re.M)) == [
        "rank=0 size=2 total=[3.0]",
        "rank=1 size=2 total=[3.0]",
    ], out[-3000:]
