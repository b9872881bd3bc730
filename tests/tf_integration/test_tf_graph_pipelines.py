"""TF1 graphs without hvdlite's asynchronous kernel: with ``--no-tf-async-kernel`` and where
the kernel cannot be built (``CXX=false``, an empty cache), the collectives run as
``tf.data`` pipelines, with the same values, errors and no deadlock on a one-thread pool
(workers/tf_graph_worker.py; test_tf_graph.py runs every case with the kernel).  Skipped
when TensorFlow is not installed."""

import importlib.util
from pathlib import Path

import pytest

from tests.torch_integration.conftest import CaseResults, launch, worker_suite

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(
        "tensorflow is not importable (pip install 'hvdlite[tensorflow]', or make install)",
        allow_module_level=True,
    )

WORKER = Path(__file__).resolve().parent / "workers" / "tf_graph_worker.py"
CASES = [
    "graph_thirty_allgathers",
    "graph_one_thread_pool_orders",
    "graph_mismatch",
    "graph_kernel_edges",
]

results, test_case, test_launch_exit_code = worker_suite(
    WORKER, CASES, args=CASES, launcher_args=("--no-tf-async-kernel",)
)


@pytest.mark.timeout(180)
def test_kernel_that_cannot_be_built_falls_back_to_pipelines(tmp_path):
    """A compiler that fails: one warning saying so, then the pipelines (the worker asserts
    the graph holds no kernel node when ``CXX=false``)."""
    cases = ["graph_thirty_allgathers", "graph_one_thread_pool_orders"]
    rc, out = launch(WORKER, args=cases, env={"CXX": "false", "XDG_CACHE_HOME": str(tmp_path)})
    got = CaseResults(rc, out, np=2)
    for case in cases:
        got.check(case)
    assert rc == 0, out[-6000:]
    assert "asynchronous TensorFlow kernel is not available" in out, out[-6000:]
    assert "false failed" in out, out[-6000:]
    assert not list(tmp_path.glob("hvdlite/*.so")), list(tmp_path.iterdir())
