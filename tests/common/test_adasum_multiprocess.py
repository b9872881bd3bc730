"""op=Adasum end to end: real launcher, real processes, Gloo and MPI (workers/adasum_worker.py).

np=2 has a single halving level (its norms' sum spans the whole job); np=4 adds a level whose
norms are summed within blocks of two ranks (under MPI: the split sub-communicators).
"""

import re

import pytest

from tests.common.conftest import assert_ok, run_job

ALLREDUCE = ["allreduce_matches_reference", "integers_refused"]
OPTIMIZER = ["optimizer_step_is_adasum_of_updates", "optimizer_api", "training_converges"]
MPI_ENV = {"HVDLITE_CPU_OPERATIONS": "mpi"}


@pytest.mark.timeout(180)
def test_gloo_two_ranks():
    proc = run_job(2, "adasum_worker.py", "--only", ",".join(ALLREDUCE + OPTIMIZER), timeout=150)
    assert_ok(proc, ALLREDUCE + OPTIMIZER, [0, 1])


@pytest.mark.timeout(180)
def test_gloo_four_ranks():
    checks = ALLREDUCE + ["optimizer_step_is_adasum_of_updates"]
    proc = run_job(4, "adasum_worker.py", "--only", ",".join(checks), timeout=150)
    assert_ok(proc, checks, [0, 1, 2, 3])


@pytest.mark.timeout(180)
def test_gloo_three_ranks_are_refused_on_every_rank():
    proc = run_job(3, "adasum_worker.py", "--only", "non_power_of_two_refused", timeout=150)
    assert_ok(proc, ["non_power_of_two_refused"], [0, 1, 2])


@pytest.mark.timeout(180)
def test_mpi_two_ranks():
    proc = run_job(
        2,
        "adasum_worker.py",
        "--only",
        ",".join(ALLREDUCE + OPTIMIZER),
        launcher="mpiexec",
        env=MPI_ENV,
        timeout=150,
    )
    assert_ok(proc, ALLREDUCE + OPTIMIZER, [0, 1])


@pytest.mark.timeout(180)
def test_mpi_four_ranks():
    proc = run_job(
        4,
        "adasum_worker.py",
        "--only",
        ",".join(ALLREDUCE),
        launcher="mpiexec",
        env=MPI_ENV,
        timeout=150,
    )
    assert_ok(proc, ALLREDUCE, [0, 1, 2, 3])


@pytest.mark.timeout(120)
def test_gloo_frozen_peer_ends_in_an_error_after_the_op_timeout():
    proc = run_job(
        2, "adasum_worker.py", "--hang", timeout=90, env={"HVDLITE_OP_TIMEOUT_SECONDS": "3"}
    )
    out = proc.stdout + proc.stderr
    m = re.search(r"RAISED HvdliteInternalError after ([\d.]+)s: .*exchange with rank 1", out)
    assert m and 2 < float(m.group(1)) < 15, out
    assert proc.returncode == 3, out
