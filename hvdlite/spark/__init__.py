"""Run an hvdlite job on a Spark cluster: Horovod's ``horovod.spark.run`` and ``run_elastic``.

Each rank is a Spark task: it runs the given function in its Python worker, with the
rank's environment set, so the function calls ``hvd.init()`` as under
``hvdlite-run``.  The driver of the Spark application serves the job's
authenticated services; the results come back to it in rank order.  How the job is
run is in :mod:`hvdlite.spark.spark_job`.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence

from hvdlite.runner.agent import settings as _settings
from hvdlite.spark.pool import HvdliteSparkError
from hvdlite.spark import spark_job

__all__ = ["run", "run_elastic", "HvdliteSparkError"]


def _refuse(use_mpi=None, use_gloo=None, extra_mpi_args=None, executable=None) -> None:
    """Arguments of Horovod's that cannot hold here, refused by name.

    Raises:
        ValueError: one of them asks for what hvdlite.spark cannot do.
    """
    if use_mpi:
        raise ValueError("hvdlite.spark: use_mpi=True: the ranks run inside Spark's Python "
                         "workers, which mpirun cannot start; hvdlite.spark runs Gloo "
                         "(drop use_mpi)")
    if use_gloo is False:
        raise ValueError("hvdlite.spark: use_gloo=False: Gloo is the only controller on "
                         "Spark (drop use_gloo)")
    if extra_mpi_args:
        raise ValueError("hvdlite.spark: extra_mpi_args: no mpirun runs on Spark")
    if executable is not None:
        raise ValueError("hvdlite.spark: executable: the ranks run in Spark's own Python "
                         "workers; choose that interpreter with spark.pyspark.python")


def _start_timeout(start_timeout: Optional[float]) -> float:
    timeout = spark_job.DEFAULT_START_TIMEOUT_S if start_timeout is None else float(start_timeout)
    if not timeout > 0:
        raise ValueError(f"hvdlite.spark: start_timeout={start_timeout}: must be positive "
                         f"seconds")
    return timeout


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        env: Optional[Dict[str, str]] = None, stdout=None, stderr=None, verbose: int = 1,
        nics=None, prefix_output_with_timestamp: bool = False, use_mpi: Optional[bool] = None,
        use_gloo: Optional[bool] = None, extra_mpi_args: Optional[str] = None,
        executable: Optional[str] = None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks as the ranks of one job.

    The tasks form one barrier stage, so Spark starts all of them together or fails
    at once when the cluster has too few task slots.  Ranks are numbered executor host
    by executor host.  Needs an active Spark session.

    Args:
        fn: the function every rank runs (it calls ``hvd.init()``); shipped by Spark.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        num_proc: the number of ranks (default: the context's ``defaultParallelism``).
        start_timeout: seconds for every task to start and register (default 600).
        env: variables set in every rank while ``fn`` runs (default: none beyond the
            executor's own environment).
        stdout, stderr, verbose, nics, prefix_output_with_timestamp: accepted for
            Horovod compatibility; the ranks' output goes to the executors' logs (the
            driver's terminal in local mode) and Gloo uses the interface each task
            reaches the driver on.
        use_mpi: must not be True (refused: no mpirun inside Spark's workers).
        use_gloo: must not be False.
        extra_mpi_args: must be unset.
        executable: must be unset (Spark's ``spark.pyspark.python`` chooses it).

    Returns:
        The ranks' results, in rank order.

    Raises:
        ValueError: a refused argument, a ``num_proc`` below 1 or above ``--max-workers``
            (``HVDLITE_MAX_WORKERS``), or a bad ``start_timeout``.
        HvdliteSparkError: no Spark session, the tasks did not start in time, or a rank
            failed (its rank, host and traceback are named; the Spark job is cancelled).
    """
    _refuse(use_mpi, use_gloo, extra_mpi_args, executable)
    timeout = _start_timeout(start_timeout)
    sc = spark_job.spark_context()
    count = sc.defaultParallelism if num_proc is None else int(num_proc)
    _settings.check_sizes(count, names=spark_job.SIZES, ceiling=_settings.platform_ceiling())
    return spark_job.run_static(sc, fn, args, kwargs, count, timeout, env)


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (),
                kwargs: Optional[Dict] = None, num_proc: Optional[int] = None,
                min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
                start_timeout: Optional[float] = None, elastic_timeout: Optional[float] = None,
                reset_limit: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                stdout=None, stderr=None, verbose: int = 1, nics=None,
                prefix_output_with_timestamp: bool = False) -> List[Any]:
    """Run an elastic ``fn`` (one using ``hvd.elastic.run``) on Spark tasks that may come
    and go.

    Each task is a single-task Spark job, so a task that dies fails only itself: the
    agent blacklists its slot, the others reset to their last commit, and a new Spark
    job brings a replacement that joins the next round.

    Args:
        fn: the elastic training function every rank runs.
        args: positional arguments for ``fn``.
        kwargs: keyword arguments for ``fn``.
        num_proc: ranks of the first round (default: ``defaultParallelism``).
        min_num_proc: fewest ranks training may continue with (default ``num_proc``).
        max_num_proc: most ranks, and the number of tasks kept alive (default
            ``num_proc``).
        start_timeout: seconds a rank waits for the rendezvous when it starts (default 600).
        elastic_timeout: seconds to wait for ``min_num_proc`` ranks (default 600).
        reset_limit: the job fails once it needs more resets (default: no limit).
        env: variables set in every rank while ``fn`` runs.
        stdout, stderr, verbose, nics, prefix_output_with_timestamp: accepted for
            Horovod compatibility (see :func:`run`).

    Returns:
        The results of the last round's ranks, in rank order.

    Raises:
        ValueError: bad bounds (``HvdliteConfigError``; above ``HVDLITE_MAX_WORKERS``
            too) or a bad ``start_timeout``.
        HvdliteSparkError: no Spark session, or the job failed for good (too few ranks
            within ``elastic_timeout``, the reset limit; names the rank and host).
    """
    timeout = _start_timeout(start_timeout)
    sc = spark_job.spark_context()
    count = sc.defaultParallelism if num_proc is None else int(num_proc)
    elastic_timeout = _settings.check_elastic_timeout(elastic_timeout,
                                                      "hvdlite.spark.run_elastic: elastic_timeout")
    max_np = count if max_num_proc is None else max_num_proc
    _settings.check_sizes(count, min_num_proc, max_np, names=spark_job.SIZES,
                          ceiling=_settings.platform_ceiling())
    settings = _settings.validate(
        np=count, min_np=min_num_proc, max_np=max_np,
        reset_limit=reset_limit, cooldown_range=None, slots_per_host=None,
        discovery_script=None, fixed_hosts=False, mpi=False, names=spark_job.SIZES)
    return spark_job.run_elastic_job(sc, fn, args, kwargs, settings, timeout, env,
                                     elastic_timeout)
