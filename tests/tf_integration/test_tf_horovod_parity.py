"""hvdlite.tensorflow against Horovod's behaviour in its corners (workers/tf_horovod_parity.py):
one launch at np=2 runs every case; one at np=3 runs the cases where the order ranks
pick matters.  Skipped when TensorFlow is not installed."""

import importlib.util
import os
from pathlib import Path

import pytest

from tests.torch_integration.conftest import REPO, CaseResults, launch

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(
        "tensorflow is not importable (pip install 'hvdlite[tensorflow]', or make install)",
        allow_module_level=True,
    )

WORKER = Path(__file__).resolve().parent / "workers" / "tf_horovod_parity.py"

CASES = [
    "graph_fifty_collectives",
    "graph_feeds_and_gradients",
    "function_branch_order",
    "indexed_slices",
    "error_types",
    "dtypes",
    "public_names",
    "info_ops",
    "partial_tape",
    "sync_batch_norm",
    "tf1_api",
    "load_model",
]
#: the cases run again at np=3: where the order in which ranks run collectives matters, or
#: a size that divides nothing evenly
ORDER_CASES = [
    "graph_fifty_collectives",
    "graph_feeds_and_gradients",
    "function_branch_order",
    "indexed_slices",
    "sync_batch_norm",
    "tf1_api",
]


def _launch(np, cases=()):
    env = {
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    rc, out = launch(WORKER, args=list(cases), np=np, timeout_s=280, env=env)
    return CaseResults(rc, out, np=np)


@pytest.fixture(scope="module")
def results2():
    return _launch(2)


@pytest.fixture(scope="module")
def results3():
    return _launch(3, ORDER_CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_case_np2(results2, case):
    results2.check(case)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ORDER_CASES)
def test_case_np3(results3, case):
    results3.check(case)


@pytest.mark.timeout(300)
def test_launch_exit_codes(results2, results3):
    assert results2.rc == 0, results2.output[-6000:]
    assert results3.rc == 0, results3.output[-6000:]
