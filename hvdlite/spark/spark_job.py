"""``hvdlite.spark.run`` / ``run_elastic``: the ranks of a job as the tasks of a Spark job.

Horovod's ``horovod.spark.run``, each job run by the launcher's ``run_job``.  The driver (where the
user's Spark session lives) serves the job's task pool and rendezvous store; Spark
runs the tasks; each task registers, is given its rank's environment and calls the
user's function in its Python worker.  A static job is one barrier stage of
``num_proc`` tasks (Spark starts them together or not at all), numbered host by host
so local ranks and shared memory are right.  An elastic job keeps ``max_num_proc``
single-task Spark jobs alive: a task that dies ends only its own Spark job, the
agent blacklists its slot, and a new Spark job brings a replacement task that joins
the next round.  On the way out the job's Spark job group is cancelled and every
task still running is told to end its Python worker.
"""

import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from hvdlite.common.net.framing import new_key
from hvdlite.runner.agent.job import JobContext, run_job
from hvdlite.runner.agent.settings import JobSettings, SizeNames
from hvdlite.runner.agent.spec import JobResult, JobSpec
from hvdlite.runner.hosts import HostSlots, slots_by_node
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.tasks.function_rank import loads
from hvdlite.spark.pool import HvdliteSparkError, TaskPool
from hvdlite.spark.starter import SparkTaskHosts, SparkTaskStarter
from hvdlite.spark.task import partition_runner

log = logging.getLogger(__name__)

#: Horovod's default bound on the tasks starting
DEFAULT_START_TIMEOUT_S = 600.0
#: hvdlite.spark.run's and run_elastic's arguments, as their messages name them
SIZES = SizeNames(
    np="num_proc",
    min_np="min_num_proc",
    max_np="max_num_proc",
    reset_limit="reset_limit",
    joiner="=",
)
#: bound on the Spark job threads ending after the job group was cancelled
JOB_END_WAIT_S = 30.0
#: how often the elastic job checks that enough tasks are alive
KEEPER_INTERVAL_S = 0.5


def spark_context():
    """The active SparkContext.

    Raises:
        HvdliteSparkError: pyspark is not installed or no Spark session is active.
    """
    try:
        from pyspark import SparkContext
    except ImportError:
        raise HvdliteSparkError(
            "hvdlite.spark needs pyspark (pip install hvdlite[spark])"
        ) from None
    sc = SparkContext._active_spark_context
    if sc is None:
        raise HvdliteSparkError(
            "hvdlite.spark: no active Spark session; create one first "
            "(SparkSession.builder.getOrCreate())"
        )
    use_driver_python(sc)
    return sc


def use_driver_python(sc) -> None:
    """Make Spark's Python workers run this driver's interpreter when nothing chose one.

    With neither ``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` set, Spark runs
    ``python3`` from ``PATH``, often not the environment hvdlite is installed in: every
    task then dies with "No module named 'psutil'" under 70 lines of Java.  In local mode
    the workers run on this machine, so they get this driver's interpreter (Spark reads
    ``SparkContext.pythonExec`` for each job); on a cluster that path may not exist on the
    executors, so the driver only says what to set.
    """
    if os.environ.get("PYSPARK_PYTHON") or sc.getConf().get("spark.pyspark.python"):
        return
    found = shutil.which(sc.pythonExec)
    if found is not None and os.path.realpath(found) == os.path.realpath(sys.executable):
        return
    if sc.master.startswith("local"):
        log.warning(
            "hvdlite.spark: PYSPARK_PYTHON is not set, so Spark would run %s (%s) in "
            "its Python workers; running this driver's %s there instead",
            sc.pythonExec,
            found or "not found",
            sys.executable,
        )
        sc.pythonExec = sys.executable
        return
    log.warning(
        "hvdlite.spark: PYSPARK_PYTHON is not set: the executors run %r from their "
        "PATH, which must import hvdlite, psutil and torch (else every task fails with "
        '"No module named ..."); set PYSPARK_PYTHON (or spark.pyspark.python) to the '
        "executors' interpreter of that environment before the session starts",
        sc.pythonExec,
    )


def driver_address(sc) -> str:
    """Where the tasks reach the driver: loopback in local mode, else spark.driver.host."""
    if sc.master.startswith("local"):
        return "127.0.0.1"
    return socket.gethostbyname(sc.getConf().get("spark.driver.host"))


class SparkJob:
    """The driver's side of one hvdlite job on Spark: the task pool and the Spark jobs.

    The pool's key is the job's key too (``JobSpec.key``): the tasks get it in their
    closure, Spark's own channel, so it never crosses the pool's connection."""

    def __init__(
        self,
        sc,
        fn: Callable,
        args,
        kwargs,
        env: Optional[Dict[str, str]],
        start_timeout_s: float,
        expected: int,
    ):
        self.sc = sc
        self.key = new_key()
        self.job_id = uuid.uuid4().hex[:12]
        self.group = f"hvdlite-{self.job_id}"
        self.addr = driver_address(sc)
        self.start_timeout_s = start_timeout_s
        self.user_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.pool = TaskPool(self.key, self.addr, expected)
        self._work = (fn, args, kwargs)
        self._threads: List[threading.Thread] = []
        self._tags = 0

    def submit(self, count: int, barrier: bool, wait_s: float) -> int:
        """Start a Spark job of ``count`` tasks on a thread of its own; returns its tag."""
        from pyspark import InheritableThread

        tag, self._tags = self._tags, self._tags + 1
        fn, args, kwargs = self._work
        runner = partition_runner(self.pool.address, self.key, fn, args, kwargs, tag, wait_s)

        def go():
            why = ""
            try:
                self.sc.setJobGroup(
                    self.group, f"hvdlite job {self.job_id}", interruptOnCancel=True
                )
                rdd = self.sc.parallelize(range(count), count)
                (rdd.barrier() if barrier else rdd).mapPartitionsWithIndex(runner).collect()
            except Exception as exc:  # noqa: BLE001 -- Py4J's errors: reported by tag
                why = _first_lines(str(exc))
            self.pool.job_ended(tag, why)

        thread = InheritableThread(target=go, daemon=True, name=f"hvdlite-spark-job-{tag}")
        thread.start()
        self._threads.append(thread)
        return tag

    def spec(self, np: int, name: str, **fields) -> JobSpec:
        """The job's spec: the pool's tasks as the starter (``fields`` add the hosts and
        the elastic settings), the driver's address for the store, the pool's key."""
        missing_is_exit = fields.get("elastic") is not None

        def starter(job: JobContext) -> SparkTaskStarter:
            self.pool.on_change = job.wake
            return SparkTaskStarter(
                self.pool,
                lambda: job.job_env(local=False),
                self.addr,
                missing_is_exit=missing_is_exit,
            )

        return JobSpec(
            np=np,
            command=[],
            user_env=dict(self.user_env),
            starter=starter,
            store_address=self.addr,
            key=self.key,
            name=name,
            size_names=SIZES,
            **fields,
        ).with_start_timeout(self.start_timeout_s)

    def close(self) -> None:
        """Tell idle tasks to leave, cancel the job group, wait (bounded) for the Spark
        jobs, close the services."""
        for task in self.pool.tasks():
            if task.state == "idle" and task.order == "wait":
                self.pool.order(task, "exit")
        try:
            self.sc.cancelJobGroup(self.group)
        except Exception as exc:  # noqa: BLE001 -- the context may be stopped
            log.debug("hvdlite.spark: cancelJobGroup: %s", exc)
        deadline = time.monotonic() + JOB_END_WAIT_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning(
                "hvdlite.spark: Spark jobs of group %s still running %gs after their cancellation",
                self.group,
                JOB_END_WAIT_S,
            )
        self.pool.shutdown()

    def failure(self, result: JobResult, what: str) -> HvdliteSparkError:
        """The error naming why the agent failed the job and the rank that failed first (a
        raised exception before a lost task), its host and its traceback."""
        failures = self.pool.failures
        raised = [sid for sid in failures if not failures[sid].startswith("its ")]
        sid = (raised or list(failures) or [None])[0]
        why = (result.error or "a rank failed").strip()
        if why.startswith("hvdlite-run: "):  # the static summary's launcher prefix
            why = why[len("hvdlite-run: ") :]
        head = f"{what}: the job failed: {why}"
        if sid is None:
            return HvdliteSparkError(head)
        rank = result.ranks.index(sid) if sid in result.ranks else -1
        task = next((t for t in self.pool.tasks() if t.sid == sid), None)
        where = f"host {sid[0]}, slot {sid[1]}" + (
            f", Spark partition {task.partition}, pid {task.pid}" if task else ""
        )
        return HvdliteSparkError(f"{head}\nrank {rank} ({where}):\n{failures[sid].rstrip()}")


#: the line of a Python traceback that names the error (``ModuleNotFoundError: ...``)
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def _first_lines(text: str, count: int = 2) -> str:
    """Spark's error in short: its first lines, and the Python error a task died of (the
    last line of the task's traceback, before the JVM's stack frames)."""
    lines = [x.rstrip() for x in text.strip().splitlines() if x.strip()]
    start = next((i for i, x in enumerate(lines) if "Traceback (most recent call" in x), None)
    python = []
    for line in lines[start + 1 :] if start is not None else []:
        if line.lstrip().startswith("at "):
            break
        python.append(line)
    errors = [x.strip() for x in python if _ERROR_LINE.match(x.strip())]
    picked = lines[:count] + [x for x in errors[-1:] if x not in lines[:count]]
    return " | ".join(picked) or "no message"


def run_static(
    sc, fn, args, kwargs, num_proc: int, start_timeout_s: float, env: Optional[Dict[str, str]]
) -> List[Any]:
    """One barrier stage of ``num_proc`` tasks through the agent (see :func:`hvdlite.spark.run`)."""
    job = SparkJob(sc, fn, args, kwargs, env, start_timeout_s, num_proc)
    try:
        tag = job.submit(num_proc, barrier=True, wait_s=start_timeout_s)
        tasks = job.pool.wait_registered(
            num_proc, start_timeout_s, lambda: job.pool.jobs_ended.get(tag)
        )
        tasks.sort(key=lambda t: t.partition)
        slots = slots_by_node([t.host for t in tasks])
        for task, slot in zip(tasks, slots):
            job.pool.assign(task, (slot.hostname, slot.local_rank))
        count: Dict[str, int] = {}
        for slot in slots:
            count[slot.hostname] = count.get(slot.hostname, 0) + 1
        hosts = [HostSlots(hostname=h, slots=n) for h, n in count.items()]
        result = run_job(
            job.spec(num_proc, "hvdlite.spark.run", hosts=hosts, host_source=FixedHosts(hosts))
        )
        if result.ok:
            return [loads(r) for r in result.results]
        raise job.failure(result, "hvdlite.spark.run")
    finally:
        job.close()


def run_elastic_job(
    sc,
    fn,
    args,
    kwargs,
    settings: JobSettings,
    start_timeout_s: float,
    env: Optional[Dict[str, str]],
    elastic_timeout_s: Optional[float] = None,
) -> List[Any]:
    """Single-task Spark jobs kept alive under the elastic agent (see
    :func:`hvdlite.spark.run_elastic`; ``elastic_timeout_s`` None: the tunable's)."""
    target = settings.max_np or settings.np
    job = SparkJob(sc, fn, args, kwargs, env, start_timeout_s, target)
    job.pool.number_slots = True
    spec = job.spec(
        settings.np,
        "hvdlite.spark.run_elastic",
        hosts=[],
        elastic=settings,
        host_source=SparkTaskHosts(job.pool),
    ).with_elastic_timeout(elastic_timeout_s)
    make_tasks = spec.starter
    keeper: Optional[_Keeper] = None

    def starter(context: JobContext) -> SparkTaskStarter:
        nonlocal keeper
        keeper = _Keeper(job, target, context)
        keeper.start()
        return make_tasks(context)

    spec.starter = starter
    try:
        result = run_job(spec)
        if keeper is not None:
            keeper.stop()
        if result.ok:
            return [loads(r) for r in result.results]
        raise job.failure(result, "hvdlite.spark.run_elastic")
    finally:
        if keeper is not None:
            keeper.stop()
        job.close()


class _Keeper:
    """Keeps ``target`` tasks alive or starting: a task that ended unfinished is replaced
    by a new single-task Spark job (at most ``4 * target`` replacements)."""

    def __init__(self, job: SparkJob, target: int, context: JobContext):
        self._job = job
        self._target = target
        self._context = context
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hvdlite-spark-keeper")
        self._budget = 5 * target

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOB_END_WAIT_S)

    def _alive(self, tags: List[int]) -> int:
        pool = self._job.pool
        registered = {t.tag: t for t in pool.tasks()}
        live = 0
        for tag in tags:
            task = registered.get(tag)
            if tag in pool.jobs_ended or (task is not None and task.state == "ended"):
                continue
            live += 1
        return live

    def _loop(self) -> None:
        tags: List[int] = []
        while not self._done.is_set():
            if self._context.finishing():
                return
            missing = self._target - self._alive(tags)
            while missing > 0 and self._budget > 0 and not self._done.is_set():
                tags.append(self._job.submit(1, barrier=False, wait_s=float("inf")))
                self._budget -= 1
                missing -= 1
            self._done.wait(KEEPER_INTERVAL_S)
