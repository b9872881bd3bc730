"""Plain torch.distributed programs under hvdlite-run: torchrun's variables on every rank
(torch's store served beside the launcher, as torchrun's agent does), the failure summary naming the rank that raised
(with no hvdlite in the program), the off switch, and a Python that lacks what the
launcher's has named before anything starts."""

import json
import os
import re
import sys

import pytest

from conftest import run_launcher, worker
from tests.conftest import summary_names

sys.path.insert(0, os.path.dirname(worker("ddp_worker.py")))
import ddp_worker  # noqa: E402  (the reference: one process on the full batches)

pytestmark = pytest.mark.timeout(120)
DDP = worker("ddp_worker.py")


def _torchenv(stdout: str):
    """rank -> {name: value} from the workers' TORCHENV lines."""
    found = {}
    for rank, rest in re.findall(r"^\[(\d+)\]<stdout>:TORCHENV (.*)$", stdout, re.M):
        found[int(rank)] = dict(item.split("=", 1) for item in rest.split())
    return found


def _weights(stdout: str):
    return {
        int(rank): json.loads(rest)
        for rank, rest in re.findall(r"^\[(\d+)\]<stdout>:WEIGHTS (.*)$", stdout, re.M)
    }


def _close(a, b, tol=1e-6):
    return all(abs(x - y) <= tol for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def test_a_ddp_program_runs_unchanged_with_torchruns_variables():
    r = run_launcher(["-np", "2", sys.executable, DDP, "--with-hvdlite"], timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    env = _torchenv(r.stdout)
    for rank in (0, 1):
        assert env[rank]["RANK"] == env[rank]["ROLE_RANK"] == env[rank]["LOCAL_RANK"] == str(rank)
        assert env[rank]["WORLD_SIZE"] == env[rank]["LOCAL_WORLD_SIZE"] == "2"
        assert (env[rank]["GROUP_RANK"], env[rank]["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert env[rank]["MASTER_ADDR"] == "127.0.0.1"
        assert env[rank]["MASTER_PORT"].isdigit()
        assert env[rank]["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the launcher serves it
    assert env[0]["TORCHELASTIC_RUN_ID"] == env[1]["TORCHELASTIC_RUN_ID"] != "<unset>"
    weights = _weights(r.stdout)
    assert _close(weights[0], weights[1], 0.0)
    assert _close(weights[0], ddp_worker.train(0, 1))  # DDP averages: the full batch
    # hvdlite.init() in the same process recognises its own launcher
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:HVD rank={rank} size=2 total=3.0" in r.stdout, r.stdout


@pytest.mark.timeout(150)
def test_a_ddp_program_over_two_ssh_hosts(sshd):
    r = run_launcher(
        ["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args(), sys.executable, DDP],
        timeout=130,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    env = _torchenv(r.stdout)
    assert [(env[r_]["RANK"], env[r_]["GROUP_RANK"], env[r_]["LOCAL_RANK"]) for r_ in (0, 1)] == [
        ("0", "0", "0"),
        ("1", "1", "0"),
    ]
    assert {env[r_]["GROUP_WORLD_SIZE"] for r_ in (0, 1)} == {"2"}
    weights = _weights(r.stdout)
    assert _close(weights[0], weights[1], 0.0)
    assert _close(weights[0], ddp_worker.train(0, 1))


def test_a_rank_that_raises_in_a_ddp_program_is_named():
    r = run_launcher(["-np", "2", sys.executable, DDP, "--fail-rank", "1"], timeout=100)
    assert r.returncode != 0
    assert summary_names(r.stderr, 1, "ValueError: rank 1 gives up on purpose", "localhost"), (
        r.stderr
    )


ABORTS = """
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(60)
sys.stderr.write("terminate called after throwing an instance of 'gloo::EnforceNotMet'\\n")
sys.stderr.write("  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes\\n")
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


def test_a_rank_that_the_cpp_runtime_aborts_is_named_with_its_last_words():
    """No Python traceback, only std::terminate's line before SIGABRT (as torch's Gloo
    threads at exit): the summary quotes it and says what that one usually means."""
    r = run_launcher(["-np", "2", sys.executable, "-c", ABORTS], timeout=60)
    assert r.returncode == 128 + 6, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "hvdlite-run: rank 0 on host localhost was killed by signal "
        "SIGABRT: terminate called without an active exception (a C++ "
        "thread was still running as the process ended;"
    ), r.stderr
    assert "gc.collect() before dist.destroy_process_group()" in last, r.stderr


def test_the_off_switch_leaves_torchruns_variables_unset():
    """--no-torch-env: no variables, no store; the program's own init then fails, and the
    summary carries its exception line though the rank never reached hvdlite."""
    r = run_launcher(["-np", "2", "--no-torch-env", sys.executable, DDP], timeout=100)
    assert r.returncode != 0
    env = _torchenv(r.stdout)
    assert env[0]["RANK"] == env[0]["MASTER_ADDR"] == "<unset>", r.stdout
    assert (
        "ValueError: Error initializing torch.distributed using env:// rendezvous: "
        "environment variable RANK expected" in r.stderr.strip().splitlines()[-1]
    ), r.stderr


def _other_python(tmp_path):
    """``python3`` on a PATH of its own, the system's Python (without this venv's modules)."""
    system = "/usr/bin/python3"
    if not os.path.exists(system) or os.path.realpath(system) == os.path.realpath(sys.executable):
        pytest.skip("no other Python here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(system)
    script = tmp_path / "train.py"
    script.write_text("print('STARTED', flush=True)\nimport torch\n")
    return bin_dir, script, {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def test_a_command_python_without_the_launchers_modules_is_refused(tmp_path):
    bin_dir, script, env = _other_python(tmp_path)
    r = run_launcher(["-np", "1", "python3", str(script)], timeout=60, env=env)
    if "cannot import" not in r.stderr and r.returncode == 0:
        pytest.skip("/usr/bin/python3 has torch")
    assert r.returncode != 0 and "STARTED" not in r.stdout, r.stdout + r.stderr
    assert (
        f"the command's interpreter {bin_dir}/python3 ('python3' on PATH) cannot import "
        f"torch, which hvdlite-run's Python {sys.executable} can" in r.stderr
    ), r.stderr
    assert f"hvdlite-run ... {sys.executable} {script}" in r.stderr
    assert "Nothing was started" in r.stderr and "--allow-other-interpreter" in r.stderr


def test_allow_other_interpreter_starts_it_and_the_summary_shows_the_ranks_error(tmp_path):
    bin_dir, script, env = _other_python(tmp_path)
    r = run_launcher(
        ["-np", "1", "--allow-other-interpreter", "python3", str(script)], timeout=60, env=env
    )
    if "cannot import" not in r.stderr and r.returncode == 0:
        pytest.skip("/usr/bin/python3 has torch")
    assert r.returncode != 0 and "[0]<stdout>:STARTED" in r.stdout, r.stdout + r.stderr
    assert "cannot import torch" in r.stderr  # still warned about
    assert "ModuleNotFoundError: No module named 'torch'" in r.stderr.strip().splitlines()[-1]
