"""Real Slurm (one node, tests/slurm/cluster.py): ``hvdlite-run`` inside ``salloc``, plain
``srun``, and task services started through ``srun``, each at np=2 training to the same
weights as one process; killing the launcher leaves no task or worker behind."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hvdlite.runner.slurm.key import new_key
from tests.conftest import summary_names

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "slurm", "workers")
TRAIN = os.path.join(WORKERS, "train.py")
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def reference():
    from tests.slurm.workers.train import train

    return train(0, 1)


def _env(cluster, **extra):
    env = cluster.env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    env.pop("HVDLITE_SECRET_KEY", None)
    env["HVDLITE_START_TIMEOUT"] = "120"  # 2 shared cores: imports can be slow
    env.update(extra)
    return env


def _run(cmd, env):
    proc = subprocess.run(
        cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
    )
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _check(out_file, reference):
    with open(out_file) as f:
        result = json.load(f)
    assert result["size"] == 2
    for got, want in zip(result["weights"], reference):
        assert got == pytest.approx(want, abs=1e-6)
    return result


def test_hvdlite_run_inside_salloc_takes_the_allocation(slurm_cluster, reference, tmp_path):
    out = tmp_path / "result.json"
    proc = _run(
        ["salloc", "-n", "2", "hvdlite-run", "--verbose", sys.executable, TRAIN, "--out", str(out)],
        _env(slurm_cluster),
    )
    assert "hosts from the Slurm allocation" in proc.stderr
    assert f"{slurm_cluster.node}:2; -np 2 (the allocation's total)" in proc.stderr
    _check(out, reference)


def test_plain_srun_with_an_exported_key(slurm_cluster, reference, tmp_path):
    out = tmp_path / "result.json"
    env = _env(slurm_cluster, HVDLITE_SECRET_KEY=new_key().hex())
    _run(["srun", "-n", "2", sys.executable, TRAIN, "--out", str(out)], env)
    result = _check(out, reference)
    # the ranks are Slurm's: rank r is SLURM_PROCID r, both on the one node
    assert [p[0] for p in result["places"]] == [0, 1]
    assert [p[3] for p in result["places"]] == ["0", "1"]
    assert [p[1] for p in result["places"]] == [0, 1]


def test_plain_srun_names_a_rank_that_raises(slurm_cluster):
    """A plain srun step runs through run_job (rank 0's child): the failure summary names
    the rank that raised, its host and its exception, as hvdlite-run's does."""
    env = _env(slurm_cluster, HVDLITE_SECRET_KEY=new_key().hex())
    proc = subprocess.run(
        ["srun", "-n", "2", sys.executable, TRAIN, "--fail-rank", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert summary_names(
        proc.stderr, 1, "ValueError: rank 1 gives up on purpose", slurm_cluster.node
    ), proc.stdout + proc.stderr


def _sbatch_script() -> str:
    """The batch script of docs/clusters.md (the first bash block of its Slurm section)."""
    with open(os.path.join(ROOT, "docs", "clusters.md")) as f:
        text = f.read()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.startswith("#!/bin/bash") and "#SBATCH" in block
    return block


def test_the_documented_sbatch_script(slurm_cluster, reference, tmp_path):
    for name in os.listdir(WORKERS):
        if name.endswith(".py"):
            shutil.copy(os.path.join(WORKERS, name), tmp_path)
    (tmp_path / "job.sh").write_text(_sbatch_script())
    _run(
        [
            "sbatch",
            "--wait",
            "--nodes=1",
            "--ntasks-per-node=2",
            f"--chdir={tmp_path}",
            f"--output={tmp_path}/slurm.out",
            str(tmp_path / "job.sh"),
        ],
        _env(slurm_cluster),
    )
    for out in ("result-hvdlite-run.json", "result-srun.json"):
        assert (tmp_path / out).exists(), (tmp_path / "slurm.out").read_text()
        _check(tmp_path / out, reference)


def test_plain_srun_without_a_key_says_how_to_make_one(slurm_cluster):
    proc = subprocess.run(
        ["srun", "-n", "2", sys.executable, TRAIN],
        env=_env(slurm_cluster),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert "HVDLITE_SECRET_KEY is not set" in proc.stderr, proc.stderr


def test_task_services_through_srun(slurm_cluster, reference, tmp_path):
    out = tmp_path / "result.json"
    proc = _run(
        [
            "salloc",
            "-n",
            "2",
            sys.executable,
            "-m",
            "tests.slurm.workers.srun_job",
            sys.executable,
            TRAIN,
            "--out",
            str(out),
        ],
        _env(slurm_cluster),
    )
    assert "1/1 tasks registered" in proc.stderr
    _check(out, reference)


def _steps(cluster) -> str:
    return subprocess.run(
        ["squeue", "-h", "-s", "-o", "%j"],
        env=_env(cluster),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killing_the_launcher_ends_the_srun_tasks_and_workers(slurm_cluster, tmp_path):
    """The allocation outlives the launcher (its script sleeps on), so what ends the
    workers is srun ending its step, not the allocation ending."""
    pids, launcher_pid = tmp_path / "pids", tmp_path / "launcher.pid"
    script_pid = tmp_path / "script.pid"
    pids.mkdir()
    script = (
        f"{sys.executable} -m tests.slurm.workers.srun_job {sys.executable} "
        f"{WORKERS}/sleeper.py {pids} & echo $! > {launcher_pid}; echo $$ > {script_pid}; "
        f"wait; exec sleep 60"
    )
    salloc = subprocess.Popen(
        ["salloc", "-n", "2", "-J", "hvdlite-kill-test", "bash", "-c", script],
        env=_env(slurm_cluster),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(pids)) < 2:
            assert salloc.poll() is None and time.monotonic() < deadline, (
                "the workers did not start through srun"
            )
            time.sleep(0.2)
        workers = [int(p) for p in os.listdir(pids)]
        os.kill(int(launcher_pid.read_text()), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)], "workers outlived the killed launcher"
        assert salloc.poll() is None, "the allocation ended: the test proves nothing"
        while "hvdlite-task" in _steps(slurm_cluster) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "hvdlite-task" not in _steps(slurm_cluster), "the srun task step outlived it"
    finally:
        # salloc ignores SIGTERM; it ends (and gives the allocation back) with its script
        if script_pid.exists():
            os.kill(int(script_pid.read_text()), signal.SIGKILL)
        try:
            salloc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            subprocess.run(
                ["scancel", "-n", "hvdlite-kill-test"], env=_env(slurm_cluster), timeout=30
            )
            os.killpg(salloc.pid, signal.SIGKILL)
            salloc.wait(timeout=10)
