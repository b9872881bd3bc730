"""RayExecutor: the ranks of a job as Ray actors, each job run by the launcher's ``run_job``.

The driver (the process that calls :meth:`RayExecutor.start`) reserves one Ray
placement group, starts one actor per rank in it, learns which node each actor
landed on and numbers the ranks node by node (so local and cross ranks mean what
they mean under ``hvdlite-run``).  Each :meth:`~RayExecutor.run` /
:meth:`~RayExecutor.execute` is then one job of ``hvdlite.runner.agent.job.run_job``:
the executor's nodes are its fixed hosts and :class:`~hvdlite.ray.calls.ActorCallStarter`
its starter, so the job gets its own key, store, environment and failure summary
like any other.  Each call hands its actor its place, the store's address and the
job's key as method arguments -- never on a command line or in a log -- and the
user's function calls ``hvd.init()`` as under the launcher.  An elastic executor
runs one elastic job per :meth:`~RayExecutor.run` with Ray's live nodes as hosts
(``hvdlite.ray.elastic_workers``).
"""

import dataclasses
import logging
import threading
from typing import Any, Callable, Dict, List, Optional

from hvdlite.common.exceptions import HvdliteError
from hvdlite.ray import placement
from hvdlite.ray.calls import ActorCallStarter
from hvdlite.ray.elastic_workers import RayNodeHosts, RayActorStarter
from hvdlite.ray.worker import RankWorker
from hvdlite.runner.agent import settings as elastic_settings
from hvdlite.runner.agent.job import run_job
from hvdlite.runner.agent.spec import JobResult, JobSpec
from hvdlite.runner.hosts import HostSlots, SlotInfo, slot_id, slots_by_node
from hvdlite.runner.hosts.fixed import FixedHosts

#: RayExecutor's arguments, as its messages name them
SIZES = elastic_settings.SizeNames(np="num_workers", min_np="min_workers",
                                   max_np="max_workers", reset_limit="reset_limit", joiner="=")

log = logging.getLogger(__name__)


class HvdliteRayError(HvdliteError):
    """A rank of a Ray job failed, or the job could not be placed; names rank and node."""


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns (Horovod's argument names).

    Args:
        timeout_s: bound in seconds on the start-up steps: the actors answering and the
            rendezvous (``--start-timeout`` of ``hvdlite-run``).
        placement_group_timeout_s: bound in seconds on Ray finding room for the job's
            placement group.
    """

    #: bound on start-up steps: actors answering, the rendezvous (``--start-timeout``)
    timeout_s: float = 30.0
    #: bound on Ray finding room for the job's placement group
    placement_group_timeout_s: float = 100.0


class RayExecutor:
    """Run a function on every rank of an hvdlite job placed on a Ray cluster.

    ``RayExecutor(settings, num_workers=4, cpus_per_worker=1)`` places 4 ranks wherever
    Ray finds room (``PACK``: as few nodes as possible); ``num_hosts=2,
    num_workers_per_host=2`` asks for exactly 2 nodes with 2 ranks each
    (``STRICT_SPREAD``).  Call :meth:`start`, then :meth:`run` / :meth:`execute` as often
    as needed, then :meth:`shutdown`.  Giving ``min_workers`` or ``max_workers`` makes
    the job elastic: the launcher's elastic driver runs it with Ray's nodes as hosts.

    Args:
        settings: from :meth:`create_settings` (``None``: the defaults).
        num_workers: the number of ranks (the first round's, in an elastic job); give
            either this or ``num_hosts``.
        num_hosts: the number of nodes, each running ``num_workers_per_host`` ranks.
        num_workers_per_host: ranks per node, with ``num_hosts``.
        cpus_per_worker: the CPUs Ray reserves for each rank's actor.
        use_gpu, gpus_per_worker: must stay unset: hvdlite works on CPU tensors.
        min_workers, max_workers: the elastic job's bounds on the number of ranks.
        reset_limit: an elastic job fails once it needs more resets (``None``: no limit).
        cooldown_range: ``(min_s, max_s)``: a failed node rejoins after a cooldown drawn
            from this range (``None``: it stays out).
        elastic_timeout: seconds an elastic job waits for ``min_workers`` slots (``None``:
            ``HVDLITE_ELASTIC_TIMEOUT`` or Horovod's twin, else 600).
        override_discovery: accepted for Horovod compatibility (Ray's live nodes are
            always the hosts).

    Raises:
        ValueError: GPUs requested, both or neither of ``num_workers`` and ``num_hosts``,
            ``num_hosts`` in an elastic job, or counts that are not positive.
        HvdliteConfigError: bad elastic bounds, or a size above ``HVDLITE_MAX_WORKERS``
            (a ``ValueError`` too).
    """

    @staticmethod
    def create_settings(timeout_s: float = 30, ssh_identity_file=None, ssh_str=None,
                        placement_group_timeout_s: float = 100, nics=None) -> RaySettings:
        """Settings for :class:`RayExecutor`.

        The SSH and NIC arguments of Horovod's version are accepted and unused: actors are
        placed by Ray, and each rank's Gloo interface is the one holding its node's address.

        Args:
            timeout_s: bound in seconds on the actors starting and the rendezvous.
            ssh_identity_file, ssh_str: accepted and unused.
            placement_group_timeout_s: bound in seconds on Ray placing the job.
            nics: accepted and unused.

        Returns:
            A :class:`RaySettings`.

        Raises:
            ValueError: a timeout that is not positive.
        """
        if not timeout_s > 0 or not placement_group_timeout_s > 0:
            raise ValueError(f"create_settings: timeout_s={timeout_s} and "
                             f"placement_group_timeout_s={placement_group_timeout_s} must be "
                             f"positive seconds")
        return RaySettings(float(timeout_s), float(placement_group_timeout_s))

    def __init__(self, settings: Optional[RaySettings] = None, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None, min_workers: Optional[int] = None,
                 max_workers: Optional[int] = None, reset_limit: Optional[int] = None,
                 cooldown_range=None,
                 elastic_timeout: Optional[float] = None,
                 override_discovery: bool = True):
        if use_gpu or gpus_per_worker:
            raise ValueError("RayExecutor: use_gpu / gpus_per_worker: hvdlite works on CPU "
                             "tensors")
        self._elastic = None
        self._elastic_timeout = elastic_settings.check_elastic_timeout(
            elastic_timeout, "RayExecutor: elastic_timeout")
        if min_workers is not None or max_workers is not None:
            if num_hosts is not None:
                raise ValueError("RayExecutor: an elastic job (min_workers / max_workers) "
                                 "places its workers on Ray's nodes itself; drop num_hosts")
            first = num_workers if num_workers is not None else (min_workers or 1)
            self._elastic = elastic_settings.validate(
                np=first, min_np=min_workers, max_np=max_workers,
                reset_limit=reset_limit,
                cooldown_range=cooldown_range, slots_per_host=None, discovery_script=None,
                fixed_hosts=False, mpi=False, names=SIZES)
            num_workers = first
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give either num_workers, or num_hosts with "
                             "num_workers_per_host")
        count = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        if count < 1 or num_workers_per_host < 1 or not cpus_per_worker > 0:
            raise ValueError(f"RayExecutor: num_workers={num_workers}, num_hosts={num_hosts}, "
                             f"num_workers_per_host={num_workers_per_host}, cpus_per_worker="
                             f"{cpus_per_worker}: the counts must be positive")
        elastic_settings.check_sizes(   # the job checks again; before a placement group
            count, min_workers, max_workers, names=SIZES,
            ceiling=elastic_settings.platform_ceiling())
        self.settings = settings or RaySettings()
        self.num_workers = count
        self._num_hosts = num_hosts or 0
        self._per_host = num_workers_per_host
        self._cpus = cpus_per_worker
        self._pg = None
        self._extra_env: Dict[str, str] = {}
        self._slots: List[SlotInfo] = []
        self._driver_ip = ""
        self.workers: List[Any] = []
        self._where: List[Dict[str, Any]] = []

    # -- life cycle ---------------------------------------------------------------------------
    def start(self, executable_cls: Optional[type] = None, executable_args=None,
              executable_kwargs: Optional[dict] = None,
              extra_env_vars: Optional[Dict[str, str]] = None) -> None:
        """Place the ranks, start their actors and give each its place in the job.

        Starts Ray (``ray.init()``) if it is not running yet.  An elastic job only records
        its arguments here; its workers start in :meth:`run`.

        Args:
            executable_cls: a class each actor instantiates once, with ``executable_args``
                and ``executable_kwargs``; :meth:`execute` passes that object to its
                function.  Not supported in an elastic job.
            executable_args: positional arguments for ``executable_cls``.
            executable_kwargs: keyword arguments for ``executable_cls``.
            extra_env_vars: environment variables set in every rank before it starts.

        Raises:
            HvdliteRayError: already started, Ray could not place the job within the
                placement timeout (not enough CPUs or nodes), or an actor did not start.
            ValueError: ``executable_cls`` in an elastic job.
        """
        import ray
        if self.workers:
            raise HvdliteRayError("RayExecutor.start: already started; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        if self._elastic is not None:
            if executable_cls is not None:
                raise ValueError("RayExecutor.start: executable_cls is not supported in an "
                                 "elastic job (workers come and go); use run()")
            self._extra_env = dict(extra_env_vars or {})
            self._started = True
            return
        self._extra_env = dict(extra_env_vars or {})
        self._place()
        self._start_actors()
        self._set_up(executable_cls, executable_args, executable_kwargs)

    def _place(self) -> None:
        """Reserve the job's placement group.

        Raises:
            HvdliteRayError: Ray could not place it within the placement timeout.
        """
        import ray
        from ray.util.placement_group import placement_group
        wanted = placement.bundles(self.num_workers, self._num_hosts, self._per_host,
                                   self._cpus)
        strategy = "STRICT_SPREAD" if self._num_hosts else "PACK"
        self._pg = placement_group(wanted, strategy=strategy)
        try:
            ray.get(self._pg.ready(), timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            total = ray.cluster_resources().get("CPU", 0)
            self.shutdown()
            raise HvdliteRayError(
                f"RayExecutor: Ray could not place {self.num_workers} workers ("
                f"{self._describe()}, strategy {strategy}) within "
                f"{self.settings.placement_group_timeout_s:g}s; the cluster has {total:g} CPUs "
                f"on {len(ray.nodes())} node(s). Lower the counts or add nodes") from None

    def _start_actors(self) -> None:
        """One actor per rank in the placement group; learn where each landed.

        Raises:
            HvdliteRayError: the actors did not answer within the start timeout.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        actor = ray.remote(RankWorker)
        for i in range(self.num_workers):
            bundle = i // self._per_host if self._num_hosts else i
            strat = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle)
            self.workers.append(actor.options(num_cpus=self._cpus, scheduling_strategy=strat)
                                .remote())
        try:
            self._where = ray.get([w.where.remote() for w in self.workers],
                                  timeout=self.settings.timeout_s)
            # the address each node registered with (what the node was started with)
            for w in self._where:
                w["node_ip"] = _node_address(w["node_id"], w["node_ip"])
        except Exception as exc:
            self.shutdown()
            raise HvdliteRayError(f"RayExecutor: the workers did not start within "
                                  f"{self.settings.timeout_s:g}s: {exc}") from exc

    def _describe(self) -> str:
        if self._num_hosts:
            return (f"{self._num_hosts} nodes x {self._per_host} workers x {self._cpus:g} "
                    f"CPUs")
        return f"{self._cpus:g} CPUs each"

    def _set_up(self, executable_cls, executable_args, executable_kwargs) -> None:
        """Number the ranks node by node and give each actor its node's address and the
        user's executable class (built in the actor at its first job, inside that job's
        environment, so that its constructor may call ``hvd.init()``)."""
        import ray
        names = _node_names(self._where)
        self._slots = slots_by_node([names[w["node_id"]] for w in self._where])
        self._driver_ip = _node_address(ray.get_runtime_context().get_node_id(),
                                        ray.util.get_node_ip_address())
        calls = [w.setup.remote(where["node_ip"], executable_cls, executable_args or (),
                                executable_kwargs or {})
                 for w, where in zip(self.workers, self._where)]
        self._gather(calls, "start")
        log.info("RayExecutor: %d ranks on %d node(s); the driver is %s", len(self._slots),
                 len(set(names.values())), self._driver_ip)

    def shutdown(self) -> None:
        """End every actor, the placement group and the rendezvous store (idempotent)."""
        import ray
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as exc:        # already gone
                log.debug("RayExecutor: kill: %s", exc)
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self._pg)
            except Exception as exc:
                log.debug("RayExecutor: removing the placement group: %s", exc)
            self._pg = None

    # -- running code -------------------------------------------------------------------------
    def execute(self, fn: Callable[[Any], Any], callbacks=None) -> List[Any]:
        """Call ``fn(executable)`` on every rank and wait for the results.

        Args:
            fn: called with the object ``executable_cls`` built on that rank (or ``None``).
            callbacks: accepted for Horovod compatibility and unused.

        Returns:
            The results, in rank order.

        Raises:
            HvdliteRayError: not started, or a rank raised (its rank and node are named).
        """
        self._check_started("execute")
        return self._run_job(lambda actor, env: actor.execute.remote(fn, env), "execute")

    def run(self, fn: Callable, args=None, kwargs: Optional[dict] = None,
            callbacks=None) -> List[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank and wait for the results.

        Args:
            fn: the function each rank runs; it calls ``hvd.init()`` itself.
            args: positional arguments for ``fn``.
            kwargs: keyword arguments for ``fn``.
            callbacks: accepted for Horovod compatibility and unused.

        Returns:
            The results, in rank order (in an elastic job: those of the last round's ranks).

        Raises:
            HvdliteRayError: not started, or a rank raised (its rank, node and traceback are
                named); the other ranks' actors are ended, so the executor must be started
                again.  In an elastic job: the job failed for good.
        """
        if self._elastic is not None:
            if not getattr(self, "_started", False):
                raise HvdliteRayError("RayExecutor.run: not started (call start() first)")
            return self._run_elastic(fn, args, kwargs)
        self._check_started("run")
        args, kwargs = list(args or ()), dict(kwargs or {})
        return self._run_job(lambda actor, env: actor.run.remote(fn, args, kwargs, env), "run")

    def _spec(self, submit: Callable[[Any, Dict[str, str]], Any], what: str) -> JobSpec:
        """One job on the executor's actors: its nodes as fixed hosts, ``submit(actor,
        env)`` on every slot's actor as the starter."""
        count: Dict[str, int] = {}
        for slot in self._slots:
            count[slot.hostname] = count.get(slot.hostname, 0) + 1
        hosts = [HostSlots(hostname=h, slots=n) for h, n in count.items()]
        actors = {slot_id(s): w for s, w in zip(self._slots, self.workers)}
        return JobSpec(
            np=len(self._slots), hosts=hosts, command=[], user_env=dict(self._extra_env),
            host_source=FixedHosts(hosts),
            starter=lambda job: ActorCallStarter(
                actors, submit, job_env=lambda: job.job_env(False, with_key=True),
                on_exit=job.wake),
            store_address=self._driver_ip, name=f"RayExecutor.{what}", size_names=SIZES,
        ).with_start_timeout(self.settings.timeout_s)

    def _run_job(self, submit: Callable[[Any, Dict[str, str]], Any], what: str) -> List[Any]:
        """Run one job through ``run_job``; the results in rank order.

        Raises:
            HvdliteRayError: a rank failed (names the first, its node and its error, with
                the job's failure summary); every actor is then ended.
        """
        result = run_job(self._spec(submit, what))
        if result.ok:
            return result.results
        self._fail(result, what)

    def _fail(self, result: JobResult, what: str) -> None:
        """Raise the error naming the rank that failed first, after ending every actor.

        Raises:
            HvdliteRayError: always.
        """
        sid, why = next(iter(result.failures.items()), (None, result.error or "?"))
        index = result.ranks.index(sid) if sid in result.ranks else -1
        where = self._where[index] if 0 <= index < len(self._where) else {}
        self.shutdown()
        raise HvdliteRayError(
            f"RayExecutor.{what}: rank {index} on node {where.get('node_ip', '?')} "
            f"(host {where.get('hostname', '?')}, pid {where.get('pid', '?')}) failed; "
            f"the other ranks were ended:\n{why.strip()}\n{result.summary.strip()}".rstrip())

    def _run_elastic(self, fn, args, kwargs) -> List[Any]:
        """Run ``fn`` as one elastic job on Ray's live nodes until it succeeds; the results
        of the last round's workers, in its rank order.

        Raises:
            HvdliteRayError: the job failed (too few workers within the elastic timeout, the
                reset limit, ...); names the failed workers and why.
        """
        import ray
        driver_node = ray.get_runtime_context().get_node_id()
        driver_ip = _node_address(driver_node, ray.util.get_node_ip_address())
        discovery = RayNodeHosts(self._cpus, driver_node)
        spec = JobSpec(
            np=self._elastic.np, hosts=[], command=[], user_env=dict(self._extra_env),
            elastic=self._elastic, host_source=discovery,
            starter=lambda job: RayActorStarter(discovery, fn, args, kwargs,
                                                lambda: job.job_env(False, with_key=True),
                                                self._cpus, job.wake),
            store_address=driver_ip, name="RayExecutor.run", size_names=SIZES,
        ).with_start_timeout(self.settings.timeout_s).with_elastic_timeout(self._elastic_timeout)
        result = run_job(spec)
        if not result.ok:
            why = "; ".join(f"{h}:{lr}: {w.splitlines()[0] if w else '?'}"
                            for (h, lr), w in result.failures.items())
            raise HvdliteRayError(
                f"RayExecutor.run (elastic): the job failed with code {result.exit_code}: "
                f"{result.error or 'a worker failed'}"
                + (f" (worker failures: {why})" if why else ""))
        return result.results

    def run_remote(self, fn: Callable, args=None, kwargs: Optional[dict] = None) -> list:
        """Start ``fn(*args, **kwargs)`` on every rank without waiting.

        Args:
            fn: the function each rank runs.
            args: positional arguments for ``fn``.
            kwargs: keyword arguments for ``fn``.

        The calls are one job like :meth:`run`'s, watched on a thread of its own: a rank
        that fails ends the others (their references then raise) and the job's failure
        summary is printed.

        Returns:
            Ray object references, in rank order, for ``ray.get``.

        Raises:
            HvdliteRayError: not started, or the calls were not all made within the start
                timeout.
        """
        self._check_started("run_remote")
        args, kwargs = list(args or ()), dict(kwargs or {})
        refs: Dict[Any, Any] = {}
        made = threading.Event()

        def submit(actor, env):
            refs[actor] = ref = actor.run.remote(fn, args, kwargs, env)
            if len(refs) == len(self.workers):
                made.set()
            return ref

        spec = self._spec(submit, "run_remote")
        threading.Thread(target=run_job, args=(spec,), daemon=True,
                         name="hvdlite-ray-run-remote").start()
        if not made.wait(self.settings.timeout_s):
            raise HvdliteRayError(f"RayExecutor.run_remote: the calls were not made within "
                                  f"{self.settings.timeout_s:g}s")
        return [refs[w] for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Call ``fn(executable)`` on rank 0 only and wait for its result.

        Args:
            fn: called with the object ``executable_cls`` built on rank 0 (or ``None``).

        Returns:
            ``fn``'s result.

        Raises:
            HvdliteRayError: not started, or ``fn`` raised.
        """
        self._check_started("execute_single")
        return self._gather([self.workers[0].execute.remote(fn, None)], "execute_single")[0]

    def _check_started(self, what: str) -> None:
        if not self.workers:
            raise HvdliteRayError(f"RayExecutor.{what}: not started (call start() first; a "
                                  f"failed run ends the workers)")

    def _gather(self, refs: list, what: str) -> List[Any]:
        """Results in rank order; the first rank to fail ends them all and is named."""
        import ray
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:
                rank = index[done[0]]
                where = self._where[rank] if rank < len(self._where) else {}
                self.shutdown()
                raise HvdliteRayError(
                    f"RayExecutor.{what}: rank {rank} on node {where.get('node_ip', '?')} "
                    f"(host {where.get('hostname', '?')}, pid {where.get('pid', '?')}) failed; "
                    f"the other ranks were ended:\n{_cause(exc)}") from None
        return ray.get(refs)


def _node_address(node_id: str, fallback: str) -> str:
    """The address Ray knows ``node_id`` by (``--node-ip-address``), else ``fallback``."""
    import ray
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return fallback


def _node_names(where: List[Dict[str, Any]]) -> Dict[str, str]:
    """A readable, unique host name per Ray node: its address, plus a short id when two
    nodes share one (several Ray nodes on one machine)."""
    ips: Dict[str, set] = {}
    for w in where:
        ips.setdefault(w["node_ip"], set()).add(w["node_id"])
    return {w["node_id"]: w["node_ip"] if len(ips[w["node_ip"]]) == 1
            else f"{w['node_ip']}-{w['node_id'][:8]}" for w in where}


def _cause(exc: BaseException) -> str:
    """The rank's own error text out of Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    return text.strip()

