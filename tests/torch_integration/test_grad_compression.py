"""DistributedOptimizer with hvd.Compression.powersgd / topk at np=2, on Gloo and (when
mpiexec is on PATH) MPI: NumPy references of both algorithms over several steps, error
feedback, checkpoints, backward_passes_per_step with a process set, broadcast_optimizer_state
and elastic state, refusals (workers/grad_compression_worker.py); benchmarks/compression.py
runs."""

import json
import sys

import pytest

from hvdlite.runner.starters.mpiexec import find_mpiexec

from .conftest import REPO, WORKERS, CaseResults, launch
from tests import launching

CASES = [
    "powersgd_matches_reference",
    "powersgd_backward_passes_and_process_set",
    "topk_matches_reference",
    "topk_dense_matches_reference",
    "error_feedback_loses_nothing",
    "checkpoint_round_trip",
    "broadcast_and_elastic_state",
    "refusals",
    "channels_last_as_row_major",
    "one_checkpoint_on_every_rank",
]


def _run(launcher_args=()):
    rc, out = launch(
        WORKERS / "grad_compression_worker.py", timeout_s=150, launcher_args=launcher_args
    )
    return CaseResults(rc, out, np=2)


@pytest.fixture(scope="module")
def gloo():
    return _run()


@pytest.fixture(scope="module")
def mpi():
    if find_mpiexec() is None:
        pytest.skip("no mpiexec on PATH")
    return _run(["--mpi"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_gloo(gloo, case):
    gloo.check(case)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_mpi(mpi, case):
    mpi.check(case)


@pytest.mark.timeout(180)
def test_gloo_exit_code(gloo):
    assert gloo.rc == 0, gloo.output[-6000:]


@pytest.mark.timeout(120)
def test_compression_benchmark_smoke(tmp_path):
    """benchmarks/compression.py runs end to end (tiny sizes) and counts PowerSGD's bytes."""
    out_json = tmp_path / "compression.json"
    proc = launching.run(
        [
            "-np",
            "2",
            "--no-shared-memory",
            sys.executable,
            REPO / "benchmarks" / "compression.py",
            "--workloads",
            "mlp",
            "--width",
            "256",
            "--rounds",
            "1",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--train-steps",
            "25",
            "--json",
            out_json,
        ],
        timeout=110,
        pythonpath=[REPO],
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out_json.read_text())
    rows = data["timing"]["mlp"]["rows"]
    assert set(rows) == {"local", "none", "fp16", "powersgd-r1", "powersgd-r4", "topk-1%"}
    # 4 layers of 256 x 256 + biases: float32, (256 + 256) * 4 per matrix with rank 4
    assert rows["none"]["bytes"] == 4 * (256 * 256 + 256) * 4
    assert rows["powersgd-r4"]["bytes"] == 4 * ((256 + 256) * 4 + 256) * 4
    assert all(r["step_ms"] > 0 for r in rows.values())
    assert set(data["classifier"]) == set(rows) - {"local"}
