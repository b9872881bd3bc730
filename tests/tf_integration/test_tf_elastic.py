"""Elastic TensorFlow through the real launcher: a worker dies inside a ``tf.function`` train
step's allreduce; the survivors restore the last commit, reset and finish, and the result
equals one process on the full batch (workers/tf_elastic_train.py)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests import launching
from tests.common.conftest import ROOT

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(
        "tensorflow is not importable (pip install 'hvdlite[tensorflow]', or make install)",
        allow_module_level=True,
    )

TRAIN = os.path.join(ROOT, "tests", "tf_integration", "workers", "tf_elastic_train.py")
STEPS = 12


@pytest.mark.timeout(240)
def test_tf_worker_killed_in_tf_function_allreduce_job_finishes_from_last_commit(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n127.0.0.1:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    result = tmp_path / "result.json"
    env = {
        "PYTHONUNBUFFERED": "1",
        "ELASTIC_STEPS": str(STEPS),
        "ELASTIC_OUT": str(result),
        "ELASTIC_KILL_AT": "127.0.0.1:0:5",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    proc = launching.start(
        [
            "-np",
            "3",
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--host-discovery-script",
            script,
            sys.executable,
            TRAIN,
        ],
        env=env,
        pythonpath=[ROOT],
        cwd=ROOT,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=220)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the elastic TF job did not finish:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    with open(result) as f:
        res = json.load(f)
    assert res["history"] == list(range(STEPS)), res["history"]
    assert sorted(set(res["sizes"])) == [2, 3] and res["size"] == 2, res["sizes"]
    for got, want in zip(res["weights"], res["reference"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert "RESET" in out, out[-6000:]


def test_a_tf_error_wrapping_any_internal_error_is_a_reset():
    """Inside tf.function the runtime's error reaches Python as a TensorFlow error naming its
    class: a wait given up for a newer round (HvdliteRoundSupersededError, frequent since
    waits are sliced at 50 ms) must reset like HvdliteInternalError itself, not end the rank
    (it did: the rank exited 1 and the job waited for --elastic-timeout)."""
    pytest.importorskip("tensorflow")
    from hvdlite.common.exceptions import HvdliteInternalError
    from hvdlite.tensorflow.elastic import as_internal_error

    for name in (
        "HvdliteInternalError",
        "HvdliteRoundSupersededError",
        "HvdliteTimeoutError",
        "HvdliteStallError",
    ):
        text = f"Traceback (most recent call last):\n  ...\n{name}: rank 0: gave up\n [[{{node}}]]"
        err = as_internal_error(text)
        assert isinstance(err, HvdliteInternalError) and str(err) == "rank 0: gave up", name
    assert as_internal_error("ValueError: bad shape") is None
    assert as_internal_error("HvdliteMismatchError: shapes differ") is None
