"""The collective API end to end: real launcher, real processes, Gloo and MPI."""

import json
import re
import time

import pytest

from tests.common.conftest import assert_ok, run_job
from tests.common.workers.ops_worker import CHECKS

ALL = list(CHECKS)
FUSION_CHECKS = [
    "many_small_tensors",
    "submission_order",
    "join_uneven",
    "broadcast",
    "allgather",
    "allreduce_scaling_and_variants",
]


@pytest.fixture(scope="module")
def every_op_job(tmp_path_factory):
    """Every op with shared memory, then (a shutdown and init later, in the same job) over
    Gloo's TCP loopback, what ranks on different hosts use."""
    variants = {"shm": [{}, ALL], "tcp": [{"HVDLITE_SHARED_MEMORY": "0"}, ALL]}
    return run_job(
        2,
        "ops_worker.py",
        "--variants",
        json.dumps(variants),
        timeout=220,
        env={
            "HVD_TEST_DIR": str(tmp_path_factory.mktemp("every_op")),
            "HVD_EXPECT_BACKEND": "gloo",
        },
    )


@pytest.mark.timeout(240)
def test_every_op_gloo(every_op_job):
    assert_ok(every_op_job, [f"shm/{c}" for c in ALL], [0, 1])


@pytest.mark.timeout(240)
def test_every_op_gloo_without_shared_memory(every_op_job):
    assert_ok(every_op_job, [f"tcp/{c}" for c in ALL], [0, 1])


@pytest.mark.timeout(240)
def test_every_op_mpi(tmp_path):
    proc = run_job(
        2,
        "ops_worker.py",
        launcher="mpiexec",
        env={
            "HVD_TEST_DIR": str(tmp_path),
            "HVD_EXPECT_BACKEND": "mpi",
            "HVDLITE_CPU_OPERATIONS": "mpi",
        },
    )
    assert_ok(proc, ALL, [0, 1])


@pytest.mark.timeout(240)
def test_mpi_autodetected_under_mpiexec(tmp_path):
    proc = run_job(
        2,
        "ops_worker.py",
        "--only",
        "identity,submission_order",
        launcher="mpiexec",
        env={"HVD_TEST_DIR": str(tmp_path), "HVD_EXPECT_BACKEND": "mpi"},
    )
    assert_ok(proc, ["identity", "submission_order"], [0, 1])


#: Horovod's op semantics that depend on the world size, also checked at three ranks
SEMANTICS = [
    "autograd",
    "autograd_every_op",
    "join_every_collective",
    "objects_and_their_errors",
    "error_classes_are_runtime_errors",
    "sparse_allreduce",
    "alltoall",
    "reducescatter",
    "allreduce_scaling_and_variants",
]


@pytest.fixture(scope="module")
def three_ranks_job(tmp_path_factory):
    """With shared memory, then (after a shutdown and init in the same job) without: the
    control allreduce then runs by dissemination over Gloo's point-to-point exchange
    (three ranks: not a power of two)."""
    variants = {f"shm{flag}": [{"HVDLITE_SHARED_MEMORY": flag}, SEMANTICS] for flag in "10"}
    return run_job(
        3,
        "ops_worker.py",
        "--variants",
        json.dumps(variants),
        env={"HVD_TEST_DIR": str(tmp_path_factory.mktemp("three"))},
        timeout=220,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_op_semantics_at_three_ranks(three_ranks_job, shared_memory):
    assert_ok(three_ranks_job, [f"shm{shared_memory}/{c}" for c in SEMANTICS], [0, 1, 2])


RUNTIME_VARIANTS = {
    # a fusion threshold smaller than one tensor: nothing fuses
    "threshold_below_one_tensor": ({"HVDLITE_FUSION_THRESHOLD": "16"}, FUSION_CHECKS),
    # fused buffers pipelined in 64-byte chunks
    "pipelined_chunks": ({"HVDLITE_FUSION_CHUNK_BYTES": "64"}, FUSION_CHECKS),
    # most test tensors take the in-place path of a fused group, the smaller ones stay packed
    "big_tensors_in_place": ({"HVDLITE_INPLACE_THRESHOLD": "16"}, FUSION_CHECKS),
    "fusion_and_cache_off": (
        {"HVDLITE_FUSION_THRESHOLD": "0", "HVDLITE_CACHE_CAPACITY": "0"},
        FUSION_CHECKS + ["mismatch_errors"],
    ),
    # a cache smaller than a step's tensors keeps evicting; ranks must stay consistent
    "tiny_cache": (
        {"HVDLITE_CACHE_CAPACITY": "7"},
        ["many_small_tensors", "submission_order", "mismatch_errors"],
    ),
    "one_gloo_thread": ({"HVDLITE_GLOO_THREADS": "1", "HVDLITE_SHARED_MEMORY": "0"}, FUSION_CHECKS),
}


@pytest.fixture(scope="module")
def variants_job(tmp_path_factory):
    """Every runtime variant in one job (a shutdown and init with its tunables between
    them): one launch instead of six."""
    return run_job(
        2,
        "ops_worker.py",
        "--variants",
        json.dumps(RUNTIME_VARIANTS),
        env={"HVD_TEST_DIR": str(tmp_path_factory.mktemp("variants"))},
        timeout=220,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("variant", list(RUNTIME_VARIANTS))
def test_runtime_variants(variant, variants_job):
    assert_ok(variants_job, [f"{variant}/{c}" for c in RUNTIME_VARIANTS[variant][1]], [0, 1])


@pytest.mark.timeout(240)
def test_four_ranks(tmp_path):
    checks = [
        "allreduce_scaling_and_variants",
        "allgather",
        "alltoall",
        "reducescatter",
        "join_uneven",
        "broadcast",
        "identity",
    ]
    proc = run_job(
        4, "ops_worker.py", "--only", ",".join(checks), env={"HVD_TEST_DIR": str(tmp_path)}
    )
    assert_ok(proc, checks, [0, 1, 2, 3])


@pytest.mark.timeout(120)
def test_single_process_without_launcher(tmp_path):
    proc = run_job(1, "ops_worker.py", launcher="plain", env={"HVD_TEST_DIR": str(tmp_path)})
    assert_ok(proc, ALL, [0])


@pytest.mark.timeout(120)
def test_rank_that_dies_makes_the_others_raise():
    start = time.monotonic()
    proc = run_job(2, "failure_worker.py", "kill", timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    m = re.search(r"RAISED HvdliteInternalError after ([\d.]+)s", out)
    assert m and float(m.group(1)) < 15, out
    assert "LATER RAISED" in out, out
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_frozen_rank_ends_in_an_error_after_the_op_timeout():
    start = time.monotonic()
    proc = run_job(
        2, "failure_worker.py", "hang", timeout=90, env={"HVDLITE_OP_TIMEOUT_SECONDS": "3"}
    )
    out = proc.stdout + proc.stderr
    m = re.search(r"RAISED HvdliteInternalError after ([\d.]+)s", out)
    assert m and 2 < float(m.group(1)) < 15, out
    # rank 0 exits 3; the launcher then ends the frozen rank 1 and reports rank 0
    assert proc.returncode == 3 and "rank 0" in out, out
    assert time.monotonic() - start < 60


@pytest.mark.timeout(120)
def test_rank_that_never_calls_init_is_named_within_the_start_timeout():
    proc = run_job(2, "failure_worker.py", "noinit", timeout=90, env={"HVDLITE_START_TIMEOUT": "3"})
    out = proc.stdout + proc.stderr
    m = re.search(r"INIT FAILED after ([\d.]+)s: .*ranks \[1\] did not reach hvd.init\(\)", out)
    assert m and float(m.group(1)) < 10, out
    assert proc.returncode == 4 and "rank 0" in out, out


@pytest.mark.timeout(120)
def test_rank_that_shuts_down_makes_the_others_raise():
    proc = run_job(2, "failure_worker.py", "shutdown", timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RAISED HvdliteInternalError" in out and "rank 1 shut down" in out, out


@pytest.mark.timeout(120)
def test_stall_warning_then_error_names_missing_rank(tmp_path):
    proc = run_job(
        2,
        "failure_worker.py",
        "stall",
        timeout=90,
        env={
            "HVD_TEST_DIR": str(tmp_path),
            "HVDLITE_STALL_CHECK_TIME_SECONDS": "1",
            "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS": "2",
        },
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "tensor 'stalled' was submitted by ranks [0] but not yet by ranks [1]" in out, out
    assert "STALL ERROR" in out and "never by ranks [1]" in out, out
    assert out.count("STALL DONE") == 2, out


@pytest.mark.timeout(180)
def test_shutdown_init_twenty_cycles():
    proc = run_job(2, "failure_worker.py", "cycles", timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("CYCLES DONE") == 2, out


@pytest.mark.timeout(180)
def test_shutdown_init_twenty_cycles_mpi():
    proc = run_job(
        2,
        "failure_worker.py",
        "cycles",
        launcher="mpiexec",
        timeout=150,
        env={"HVDLITE_CPU_OPERATIONS": "mpi"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("CYCLES DONE") == 2, out
