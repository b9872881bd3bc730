"""DistributedOptimizer at np=2 equals one process on the full batch.

The cases run in workers/optimizer_worker.py.
"""

from .conftest import worker_suite

CASES = [
    "sgd_momentum",
    "adam",
    "adamw_params_path",
    "sgd_tiny_buckets",
    "sgd_bpps2",
    "adam_bpps2_params_path",
    "sgd_fp16",
    "adam_fp16_params_path",
    "sgd_op_sum",
    "sgd_op_sum_predivide",
    "sgd_average_predivide",
    "sgd_num_groups",
    "adam_explicit_groups",
    "sparse_params_path",
    "sparse_as_dense",
    "sparse_buckets",
    "custom_subclass",
    "uneven_usage",
    "errors",
    "sync_then_step",
    "set_to_none_by_module",
    "lr_scheduler",
    "channels_last",
    "sgd_momentum_after_broadcast",
    "adam_after_broadcast",
    "adamw_after_broadcast",
    "rmsprop_after_broadcast",
    "adagrad_after_broadcast",
]


results, test_case, test_launch_exit_code = worker_suite("optimizer_worker.py", CASES)
