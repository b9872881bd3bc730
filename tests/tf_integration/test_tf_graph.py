"""hvdlite.tensorflow collectives in TF1 graphs at np=2 (workers/tf_graph_worker.py): many
collectives of one ``session.run`` submitted together and fused (30 variable-size allgathers
over ten dtypes sharing one map function per output signature, grouped allgathers, grouped
IndexedSlices allreduces, each within 3 s),
Horovod's build-one-and-run-it loop running each collective once, a one-thread inter-op pool
with ranks building in different orders, and a mismatch raising FailedPreconditionError.
Skipped when TensorFlow is not installed."""

import importlib.util
from pathlib import Path

import pytest

from tests.torch_integration.conftest import worker_suite

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(
        "tensorflow is not importable (pip install 'hvdlite[tensorflow]', or make install)",
        allow_module_level=True,
    )

CASES = [
    "graph_thirty_allgathers",
    "graph_grouped_allgathers",
    "graph_grouped_indexed_slices",
    "graph_evaluate_loop",
    "graph_one_thread_pool_orders",
    "graph_mismatch",
    "graph_grouped_gradients",
    "graph_kernel_edges",
]

# an absolute path: worker_suite's folder (the torch workers') does not apply
results, test_case, test_launch_exit_code = worker_suite(
    Path(__file__).resolve().parent / "workers" / "tf_graph_worker.py", CASES
)
