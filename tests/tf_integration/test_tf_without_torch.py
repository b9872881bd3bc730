"""hvdlite.tensorflow on a machine without torch: the TensorFlow suite's cases under
``hvdlite-run --mpi`` with torch blocked (numpy buffers), and Gloo refused with one line.

torch is blocked inside the workers (``no_torch.block_torch`` before hvdlite is imported), so
these run in the project's one environment.  The TF suite is one launch of
``workers/tf_worker.py --no-torch``; its last case checks torch never got imported.
"""

import importlib.util
import os
import time
from pathlib import Path

import pytest

from hvdlite.runner.starters.mpiexec import find_mpiexec
from tests.tf_integration.test_tensorflow import CASES
from tests.torch_integration.conftest import REPO, CaseResults, launch

# a Path: launch() names the script (``.name``) when it times out
HERE = Path(__file__).resolve().parent / "workers"
#: Keras training runs in the TF suite's own launch; here it would only repeat, for time, the
#: numpy crossing every op case above it already takes
KERAS_TRAINING = {
    "keras_fit",
    "keras_backward_passes",
    "keras_lr_callbacks",
    "partial_tape_training",
    "sync_batch_norm_training",
}
NO_TORCH_CASES = [c for c in CASES if c not in KERAS_TRAINING] + ["no_torch"]
ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
}

needs_tf = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not importable"
)
needs_mpi = pytest.mark.skipif(
    find_mpiexec() is None or importlib.util.find_spec("mpi4py") is None,
    reason="no mpiexec on PATH or no mpi4py",
)


@pytest.fixture(scope="module")
def results():
    rc, out = launch(
        HERE / "tf_worker.py",
        args=["--no-torch", *NO_TORCH_CASES],
        np=2,
        timeout_s=280,
        env=ENV,
        launcher_args=["--mpi"],
    )
    return CaseResults(rc, out, np=2)


@needs_tf
@needs_mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", NO_TORCH_CASES)
def test_case_without_torch(results, case):
    results.check(case)


@needs_tf
@needs_mpi
@pytest.mark.timeout(300)
def test_launch_exit_code_without_torch(results):
    assert results.rc == 0, results.output[-6000:]


@needs_tf
@pytest.mark.timeout(120)
def test_one_process_without_torch():
    """No launcher: the local backend on numpy buffers."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, str(HERE / "one_process_without_torch.py")],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=110,
        env=dict(os.environ, **ENV),
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-4000:]


@pytest.mark.timeout(60)
def test_gloo_without_torch_fails_at_once_with_one_clear_line():
    start = time.monotonic()
    rc, out = launch(HERE / "gloo_without_torch.py", np=2, timeout_s=50, env=ENV)
    took = time.monotonic() - start
    assert rc != 0, out[-3000:]
    assert "init returned" not in out, out[-3000:]
    # one per rank that got there before the launcher ended the job after the first exit,
    # and the launcher's summary, which names the rank with that same line
    lines = [
        ln
        for ln in out.splitlines()
        if "HvdliteConfigError:" in ln and not ln.startswith("hvdlite-run:")
    ]
    assert 1 <= len(lines) <= 2, out[-3000:]
    summary = [ln for ln in out.splitlines() if ln.startswith("hvdlite-run: rank")]
    assert len(summary) == 1 and "Gloo transport comes from torch.distributed" in summary[0], out[
        -3000:
    ]
    for ln in lines:
        assert "Gloo transport comes from torch.distributed" in ln and "--mpi" in ln, ln
        assert "install torch" in ln, ln
    assert "During handling" not in out and "ModuleNotFoundError" not in out, out[-3000:]
    assert took < 40, f"took {took:.0f}s"
