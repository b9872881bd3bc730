"""allreduce / grouped_allreduce / reducescatter / grouped_reducescatter with
``compression=hvd.Compression.fp16`` at np=2 (workers/compression_worker.py)."""

from .conftest import worker_suite

CASES = [
    "allreduce_fp16",
    "allreduce_fp16_gradient",
    "grouped_allreduce_mixed_dtypes",
    "grouped_allreduce_fp16_gradient",
    "reducescatter_fp16",
    "reducescatter_fp16_gradient",
    "grouped_reducescatter_mixed_dtypes",
]


results, test_case, test_launch_exit_code = worker_suite("compression_worker.py", CASES)
