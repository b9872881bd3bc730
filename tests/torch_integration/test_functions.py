"""broadcast_* / *_object / SyncBatchNorm at np=2 (workers/functions_worker.py)."""

from .conftest import worker_suite

CASES = [
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_lazy_state",
    "broadcast_empty_state_as_horovod",
    "broadcast_state_no_grad",
    "broadcast_with_scheduler",
    "distributed_optimizer_state",
    "objects",
    "sync_batch_norm",
]


results, test_case, test_launch_exit_code = worker_suite("functions_worker.py", CASES)
