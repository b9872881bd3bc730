"""The driver's task pool, the Spark starter and the task loop without Spark: tasks as threads
of this process calling ``serve_task`` (what each Spark task runs), driven by the real agent.
These run where pyspark is not installed too."""

import os
import sys
import threading

import pytest

from hvdlite.common import config as cfg
from hvdlite.common.net.service import Client
from hvdlite.runner.agent.job import run_job
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.tasks.function_rank import loads
from hvdlite.spark.spark_job import SparkJob
from hvdlite.spark.task import serve_task
from tests.conftest import summary_names


class FakeContext:
    """What SparkJob reads from a SparkContext when nothing is submitted."""

    master = "local[2]"
    cancelled = []

    def cancelJobGroup(self, group):  # noqa: N802 -- Spark's name
        self.cancelled.append(group)


def _rank_and_key():
    return int(os.environ[cfg.RANK]), bool(os.environ.get(cfg.SECRET_KEY))


def _raise_on_rank_1():
    if os.environ[cfg.RANK] == "1":
        raise KeyError("no such column")
    return "fine"


def _static_job(fn, count=2):
    """Run ``fn`` as a static job of ``count`` thread tasks through ``run_job``, as
    ``hvdlite.spark.run`` does; returns (the Spark job, the JobResult)."""
    job = SparkJob(FakeContext(), fn, (), {}, {"EXTRA_FOR_TEST": "1"}, 10.0, count)
    threads = [
        threading.Thread(
            target=serve_task, daemon=True, args=(job.pool.address, job.key, fn, (), {}, i, 0, 10.0)
        )
        for i in range(count)
    ]
    for t in threads:
        t.start()
    tasks = job.pool.wait_registered(count, 10.0, lambda: None)
    for i, task in enumerate(sorted(tasks, key=lambda t: t.partition)):
        job.pool.assign(task, (task.host, i))
    hosts = [HostSlots(hostname=tasks[0].host, slots=count)]
    result = run_job(job.spec(count, "test", hosts=hosts, host_source=FixedHosts(hosts)))
    for t in threads:
        t.join(10)
    return job, result


@pytest.mark.timeout(60)
def test_static_job_results_in_rank_order_with_the_rank_env():
    job, result = _static_job(_rank_and_key, count=3)
    try:
        assert result.exit_code == 0 and result.state == "succeeded"
        assert [loads(r) for r in result.results] == [(0, True), (1, True), (2, True)]
        assert cfg.SECRET_KEY not in os.environ and "EXTRA_FOR_TEST" not in os.environ
    finally:
        job.close()
    assert job.group in FakeContext.cancelled


@pytest.mark.timeout(60)
def test_static_job_failure_names_the_rank_and_its_traceback():
    job, result = _static_job(_raise_on_rank_1)
    try:
        assert result.exit_code != 0 and result.state == "failed"
        text = str(job.failure(result, "hvdlite.spark.run"))
        assert "rank 1 (host" in text and "KeyError: 'no such column'" in text
        assert "Traceback" in text
        # the launcher's summary names the rank and its exception, as hvdlite-run's does
        assert summary_names(result.summary, 1, "KeyError: 'no such column'"), result.summary
    finally:
        job.close()


@pytest.mark.timeout(30)
def test_elastic_pool_numbers_slots_per_host_and_never_reuses_one():
    job = SparkJob(FakeContext(), None, (), {}, None, 10.0, 3)
    job.pool.number_slots = True
    client = Client(job.pool.address, job.key, timeout_s=5)
    try:
        numbers = [
            client.request({"op": "register", "host": h, "pid": 1, "partition": 0, "tag": tag})[0][
                "task"
            ]
            for tag, h in enumerate(["a", "b", "a"])
        ]
        assert [t.sid for t in job.pool.tasks()] == [("a", 0), ("b", 0), ("a", 1)]
        assert [(h.hostname, h.slots) for h in job.pool.live_hosts()] == [("a", 2), ("b", 1)]
        job.pool.job_ended(2, "Python worker exited unexpectedly")  # task ("a", 1) died
        assert [(h.hostname, h.slots) for h in job.pool.live_hosts()] == [("a", 1), ("b", 1)]
        again = client.request({"op": "register", "host": "a", "pid": 2, "partition": 0, "tag": 3})[
            0
        ]["task"]
        assert job.pool.tasks()[again].sid == ("a", 2)
        assert numbers == [0, 1, 2]
    finally:
        client.close()
        job.close()


@pytest.mark.timeout(30)
def test_a_stranger_without_the_key_is_refused():
    job = SparkJob(FakeContext(), None, (), {}, None, 10.0, 1)
    client = Client(job.pool.address, b"\x00" * 32, timeout_s=3)
    try:
        with pytest.raises(ConnectionError):
            client.request({"op": "register", "host": "x", "pid": 1, "partition": 0})
        assert job.pool.tasks() == []
    finally:
        client.close()
        job.close()


@pytest.mark.timeout(30)
def test_a_running_task_whose_heartbeat_stops_is_lost(monkeypatch):
    import time
    from hvdlite.spark import pool as pool_module

    job = SparkJob(FakeContext(), None, (), {}, None, 10.0, 1)
    job.pool.number_slots = True
    client = Client(job.pool.address, job.key, timeout_s=5)
    try:
        number = client.request(
            {"op": "register", "host": "a", "pid": 7, "partition": 0, "tag": 0}
        )[0]["task"]
        task = job.pool.tasks()[number]
        job.pool.order(task, "run", {"X": "1"})
        reply, _ = client.request({"op": "order", "task": number})
        assert reply["order"] == "run" and reply["env"] == {"X": "1"}
        assert job.pool.take_exits() == []  # running, recently seen
        monkeypatch.setattr(pool_module, "TASK_LOST_S", 0.2)
        time.sleep(0.4)  # no beat meanwhile
        assert job.pool.take_exits() == [(("a", 0), pool_module.LOST_EXIT)]
        assert "heartbeat stopped" in job.pool.failures[("a", 0)]
        # its late report changes nothing: the exit was counted once
        client.request({"op": "result", "task": number}, b"late")
        assert job.pool.take_exits() == [] and ("a", 0) not in job.pool.results
    finally:
        client.close()
        job.close()


class _Conf(dict):
    def get(self, key, default=None):  # SparkConf.get's shape
        return dict.get(self, key, default)


class _PythonContext:
    def __init__(self, master, conf=None):
        self.master = master
        self.pythonExec = "python3"  # pyspark's default without PYSPARK_PYTHON
        self._conf = _Conf(conf or {})

    def getConf(self):  # noqa: N802 -- Spark's name
        return self._conf


def test_local_spark_workers_get_the_drivers_python(monkeypatch, caplog):
    """Without PYSPARK_PYTHON, local Spark would run the python3 on PATH (here not this
    venv's): the driver's interpreter is used instead, and said so."""
    from hvdlite.spark.spark_job import use_driver_python

    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    sc = _PythonContext("local[2]")
    use_driver_python(sc)
    if sc.pythonExec == "python3":
        pytest.skip("python3 on PATH is this venv's Python")
    assert sc.pythonExec == sys.executable
    assert "PYSPARK_PYTHON is not set, so Spark would run python3" in caplog.text


def test_on_a_cluster_the_spark_python_is_left_with_a_hint(monkeypatch, caplog):
    from hvdlite.spark.spark_job import use_driver_python

    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    sc = _PythonContext("spark://head:7077")
    use_driver_python(sc)
    assert sc.pythonExec == "python3"
    assert "set PYSPARK_PYTHON (or spark.pyspark.python)" in caplog.text
    caplog.clear()
    chosen = _PythonContext("local[2]", {"spark.pyspark.python": "/opt/py/bin/python"})
    use_driver_python(chosen)  # the user's choice is left alone
    assert chosen.pythonExec == "python3" and not caplog.text
