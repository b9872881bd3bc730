"""hvdlite.spark.run / run_elastic on a real Spark session in local mode (local[2]): real
allreduces between Spark tasks, a raising rank named, an elastic job surviving a task whose
Python worker is SIGKILLed, and no Spark job or Python worker left running afterwards."""

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (make install)")

import hvdlite.spark  # noqa: E402
from tests.conftest import summary_names  # noqa: E402
from tests.elastic.workers.elastic_train import reference  # noqa: E402
from tests.spark.example_cell import elastic_train, fails_on_rank_1, train  # noqa: E402

pytestmark = pytest.mark.spark
REPO = Path(__file__).resolve().parent.parent.parent


def _spark_processes():
    """This test process's descendants that are Spark's Python daemon or workers."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any(part.startswith(("pyspark.daemon", "pyspark.worker")) for part in p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.fixture(scope="module")
def sc():
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this venv's
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("hvdlite-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.executorEnv.PYTHONPATH", str(REPO))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    yield spark.sparkContext
    workers = _spark_processes()
    spark.stop()
    gone, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive, f"Spark Python workers left running: {alive}"


def _no_active_jobs(sc, within_s=15.0):
    deadline = time.monotonic() + within_s
    while sc.statusTracker().getActiveJobsIds() and time.monotonic() < deadline:
        time.sleep(0.2)
    return not sc.statusTracker().getActiveJobsIds()


@pytest.mark.timeout(120)
def test_run_returns_results_in_rank_order_after_allreduce(sc):
    results = hvdlite.spark.run(train, args=(10,), num_proc=2, start_timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["size"], r["local_size"]) == (2, 2)
        assert r["total"] == 30.0  # (1 + 2) * 10, summed across the tasks
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    assert _no_active_jobs(sc)


@pytest.mark.timeout(60)
def test_a_second_job_runs_in_the_reused_python_workers(sc):
    # Spark reuses its Python workers: the first job's rendezvous round must not leak
    first = hvdlite.spark.run(train, args=(1,), num_proc=2, start_timeout=60)
    again = hvdlite.spark.run(train, args=(2,), num_proc=2, start_timeout=60)
    assert [r["total"] for r in first + again] == [3.0, 3.0, 6.0, 6.0]


@pytest.mark.timeout(120)
def test_raising_rank_is_named_and_job_cancelled(sc, capfd):
    with pytest.raises(hvdlite.spark.HvdliteSparkError) as info:
        hvdlite.spark.run(fails_on_rank_1, num_proc=2, start_timeout=60)
    text = str(info.value)
    assert "rank 1" in text and "rank one refuses" in text and "ValueError" in text
    assert "Traceback" in text
    # the job ran through run_job: the same failure summary as hvdlite-run's, on stderr
    err = capfd.readouterr().err
    assert summary_names(err, 1, "ValueError: rank one refuses"), err
    assert _no_active_jobs(sc), "the failed job's Spark job is still running"


@pytest.mark.timeout(60)
def test_refused_arguments(sc):
    with pytest.raises(ValueError, match="use_mpi"):
        hvdlite.spark.run(train, args=(1,), num_proc=2, use_mpi=True)
    with pytest.raises(ValueError, match="spark.pyspark.python"):
        hvdlite.spark.run(train, args=(1,), num_proc=2, executable="/usr/bin/python3")
    with pytest.raises(ValueError, match="num_proc"):
        hvdlite.spark.run(train, args=(1,), num_proc=0)


@pytest.mark.timeout(60)
def test_more_tasks_than_slots_time_out_and_are_cancelled(sc):
    with pytest.raises(hvdlite.spark.HvdliteSparkError, match="only 0 of 3 Spark tasks"):
        hvdlite.spark.run(train, args=(1,), num_proc=3, start_timeout=3)
    assert _no_active_jobs(sc), "the barrier stage waiting for slots was not cancelled"


@pytest.mark.timeout(180)
def test_run_elastic_survives_a_killed_task(sc):
    import socket

    steps = 12
    results = hvdlite.spark.run_elastic(
        elastic_train,
        kwargs={"steps": steps, "kill_at": [socket.gethostname(), 1, 4]},
        num_proc=2,
        min_num_proc=2,
        max_num_proc=2,
        start_timeout=60,
        elastic_timeout=60,
    )
    weight, bias = reference(steps)
    assert [r["rank"] for r in results] == list(range(len(results))) and results
    for r in results:
        assert r["history"] == list(range(steps)), r["history"]
        assert r["weight"] == pytest.approx(weight, abs=1e-5)
        assert r["bias"] == pytest.approx(bias, abs=1e-5)
        assert r["sizes"] == [2] * steps
    # the killed worker (slot 1) is out; the replacement task (slot 2) joined: min_num_proc=2
    # means the job could not have finished without it
    assert sorted(r["slot"][1] for r in results) == [0, 2]
    assert _no_active_jobs(sc)


def test_docs_notebook_cell_is_the_tested_code():
    import inspect

    cell = (REPO / "docs" / "clusters.md").read_text()
    assert inspect.getsource(train) in cell
    assert "hvdlite.spark.run(train, args=(10,), num_proc=2)" in cell
