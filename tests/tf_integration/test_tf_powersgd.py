"""hvdlite.tensorflow.keras.DistributedOptimizer with hvd.Compression.powersgd at np=2
(workers/tf_powersgd_worker.py): NumPy reference eagerly and traced, state in optimizer
variables, refusals."""

import importlib.util
import os
from pathlib import Path

import pytest

from tests.torch_integration.conftest import REPO, CaseResults, launch

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip("tensorflow is not importable (pip install 'hvdlite[tensorflow]', or make "
                "install)", allow_module_level=True)

WORKER = Path(__file__).resolve().parent / "workers" / "tf_powersgd_worker.py"
CASES = ["matches_reference", "state_in_variables", "refusals"]


@pytest.fixture(scope="module")
def results():
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    rc, out = launch(WORKER, np=2, timeout_s=200, env=env)
    return CaseResults(rc, out, np=2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
def test_case(results, case):
    results.check(case)


@pytest.mark.timeout(240)
def test_launch_exit_code(results):
    assert results.rc == 0, results.output[-6000:]
