"""hvdlite.tensorflow and hvdlite.tensorflow.keras at np=2 through the real launcher.

One launch of workers/tf_worker.py runs every case (TensorFlow's import is slow); each case
is one test here, naming the ranks it failed on.  Skipped when TensorFlow is not installed
(``make install`` installs it, so CI runs these).
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.torch_integration.conftest import REPO, CaseResults, launch

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(
        "tensorflow is not importable (pip install 'hvdlite[tensorflow]', or make install)",
        allow_module_level=True,
    )

# a Path: launch() names the script (``.name``) when it times out
WORKER = Path(__file__).resolve().parent / "workers" / "tf_worker.py"

CASES = [
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "misc",
    "process_set",
    "indexed_slices",
    "gradients",
    "indexed_slices_average",
    "graph_gradients",
    "partial_tape_training",
    "sync_batch_norm_training",
    "gradient_tape_training",
    "keras_fit",
    "keras_backward_passes",
    "keras_lr_callbacks",
    "elastic_state",
    "signatures",
]
#: Keras DistributedOptimizer with hvd.Compression.powersgd (workers/tf_powersgd_worker.py):
#: the NumPy reference eagerly and traced, the state in optimizer variables, refusals; in
#: this launch only (not the one without torch)
POWERSGD_CASES = ["powersgd_matches_reference", "powersgd_state_in_variables", "powersgd_refusals"]


@pytest.fixture(scope="module")
def results():
    env = {
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    rc, out = launch(WORKER, np=2, timeout_s=280, env=env)
    return CaseResults(rc, out, np=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES + POWERSGD_CASES)
def test_case(results, case):
    results.check(case)


@pytest.mark.timeout(300)
def test_launch_exit_code(results):
    assert results.rc == 0, results.output[-6000:]


@pytest.mark.timeout(120)
def test_single_process_import_and_ops(tmp_path):
    """``import hvdlite.tensorflow`` and one op in a plain process (size 1, no launcher)."""
    import subprocess

    code = (
        "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='2'\n"
        "import tensorflow as tf, hvdlite.tensorflow as hvd\n"
        "hvd.init(); assert hvd.size() == 1\n"
        "y = hvd.allreduce(tf.constant([1.0, 2.0]))\n"
        "assert y.numpy().tolist() == [1.0, 2.0], y\n"
        "hvd.shutdown(); print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
