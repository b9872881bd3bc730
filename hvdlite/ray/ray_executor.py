"""RayExecutor: the ranks of a job as Ray actors, rendezvousing through the driver.

The driver (the process that calls :meth:`RayExecutor.start`) reserves one Ray
placement group for the job, starts one actor per rank in it, learns which node
each actor landed on, numbers the ranks node by node (so local and cross ranks
mean what they mean under ``hvdlite-run``), and serves the job's authenticated
rendezvous store on its own node address.  Each actor receives its place, the
store's address and the job's key as method arguments -- never on a command line
or in a log -- and the user's function then calls ``hvd.init()`` as under the
launcher: same runtime, same transport.
"""

import dataclasses
import logging
import uuid
from typing import Any, Callable, Dict, List, Optional

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteError
from hvdlite.common.net.framing import new_key
from hvdlite.ray import placement
from hvdlite.ray.elastic_workers import RayNodeDiscovery, RayWorkers, elastic_env
from hvdlite.ray.calls import ActorCalls
from hvdlite.ray.worker import RankWorker
from hvdlite.runner.agent import settings as elastic_settings
from hvdlite.runner.agent.settings import JobSettings
from hvdlite.runner.agent.state_machine import Agent
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.processes.workers import slot_env
from hvdlite.runner.hosts import slot_id
from hvdlite.runner.store.rendezvous import RendezvousService

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
        elastic_timeout: seconds an elastic job waits for ``min_workers`` slots.
        override_discovery: accepted for Horovod compatibility (Ray's live nodes are
            always the hosts).

    Raises:
        ValueError: GPUs requested, both or neither of ``num_workers`` and ``num_hosts``,
            ``num_hosts`` in an elastic job, or counts that are not positive.
        HvdliteConfigError: bad elastic bounds (a ``ValueError`` too).
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
                 cooldown_range=None, elastic_timeout: float = 600,
                 override_discovery: bool = True):
        if use_gpu or gpus_per_worker:
            raise ValueError("RayExecutor: use_gpu / gpus_per_worker: hvdlite works on CPU "
                             "tensors")
        self._elastic = None
        if min_workers is not None or max_workers is not None:
            if num_hosts is not None:
                raise ValueError("RayExecutor: an elastic job (min_workers / max_workers) "
                                 "places its workers on Ray's nodes itself; drop num_hosts")
            first = num_workers if num_workers is not None else (min_workers or 1)
            self._elastic = elastic_settings.validate(
                np=first, min_np=min_workers, max_np=max_workers,
                elastic_timeout_s=elastic_timeout, reset_limit=reset_limit,
                cooldown_range=cooldown_range, slots_per_host=None, discovery_script=None,
                fixed_hosts=False, mpi=False)
            num_workers = first
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give either num_workers, or num_hosts with "
                             "num_workers_per_host")
        count = num_workers if num_workers is not None else num_hosts * num_workers_per_host
        if count < 1 or num_workers_per_host < 1 or not cpus_per_worker > 0:
            raise ValueError(f"RayExecutor: num_workers={num_workers}, num_hosts={num_hosts}, "
                             f"num_workers_per_host={num_workers_per_host}, cpus_per_worker="
                             f"{cpus_per_worker}: the counts must be positive")
        self.settings = settings or RaySettings()
        self.num_workers = count
        self._num_hosts = num_hosts or 0
        self._per_host = num_workers_per_host
        self._cpus = cpus_per_worker
        self._pg = None
        self._store: Optional[RendezvousService] = None
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
        self._place()
        self._start_actors()
        self._rendezvous(executable_cls, executable_args, executable_kwargs, extra_env_vars)

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

    def _rendezvous(self, executable_cls, executable_args, executable_kwargs,
                    extra_env_vars) -> None:
        import ray
        names = _node_names(self._where)
        slots = slots_by_node([names[w["node_id"]] for w in self._where])
        key = new_key()
        driver_ip = _node_address(ray.get_runtime_context().get_node_id(),
                                  ray.util.get_node_ip_address())
        self._store = RendezvousService(key, slots, bind_addr=driver_ip)
        job_env = {
            cfg.RENDEZVOUS_ADDR: driver_ip,
            cfg.RENDEZVOUS_PORT: str(self._store.address[1]),
            cfg.SECRET_KEY: key.hex(),
            cfg.JOB_ID: uuid.uuid4().hex[:12],
            cfg.CPU_OPERATIONS: "gloo",
            cfg.START_TIMEOUT: str(self.settings.timeout_s),
        }
        job_env.update(extra_env_vars or {})
        self._slots = slots
        calls = [w.setup.remote(slot_env(slot, {}, job_env), where["node_ip"], executable_cls,
                                executable_args or (), executable_kwargs or {})
                 for w, slot, where in zip(self.workers, slots, self._where)]
        self._gather(calls, "start")
        log.info("RayExecutor: %d ranks on %d node(s), rendezvous at %s:%d", len(slots),
                 len(set(names.values())), driver_ip, self._store.address[1])

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
        if self._store is not None:
            self._store.shutdown()
            self._store = None

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
        return self._run_job(lambda actor: actor.execute.remote(fn), "execute")

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
        return self._run_job(lambda actor: actor.run.remote(fn, args, kwargs), "run")

    def _run_job(self, submit: Callable[[Any], Any], what: str) -> List[Any]:
        """One job through the launcher's agent: the executor's nodes as a fixed host
        source, ``submit(actor)`` on every slot's actor as the starter; the results in
        worker order.

        Raises:
            HvdliteRayError: a rank failed (names the first, its node and its error); every
                actor is then ended.
        """
        order: Dict[str, int] = {}
        for slot in self._slots:
            order[slot.hostname] = order.get(slot.hostname, 0) + 1
        source = FixedHosts([HostSlots(hostname=h, slots=n) for h, n in order.items()])
        actors = {slot_id(s): w for s, w in zip(self._slots, self.workers)}
        starter = ActorCalls(actors, submit, self._store.address[0])
        agent = Agent(JobSettings.static_job(len(self._slots)), source, starter, self._store)
        starter.on_exit = agent.wake
        if agent.run() == 0:
            return [starter.results[slot_id(s)] for s in self._slots]
        sid, why = next(iter(starter.failures.items()), (None, agent.error or "?"))
        index = next((i for i, s in enumerate(self._slots) if slot_id(s) == sid), -1)
        where = self._where[index] if 0 <= index < len(self._where) else {}
        self.shutdown()
        raise HvdliteRayError(
            f"RayExecutor.{what}: rank {index} on node {where.get('node_ip', '?')} "
            f"(host {where.get('hostname', '?')}, pid {where.get('pid', '?')}) failed; "
            f"the other ranks were ended:\n{why.strip()}")

    def _run_elastic(self, fn, args, kwargs) -> List[Any]:
        """Run ``fn`` under the elastic driver until the job succeeds; the results of the
        last round's workers, in its rank order.

        Raises:
            HvdliteRayError: the job failed (too few workers within the elastic timeout, the
                reset limit, ...); names the failed workers and why.
        """
        import ray
        key = new_key()
        driver_node = ray.get_runtime_context().get_node_id()
        driver_ip = _node_address(driver_node, ray.util.get_node_ip_address())
        job_id = uuid.uuid4().hex[:12]
        rounds = RendezvousService(key, repeat_last=False, bind_addr=driver_ip, job_id=job_id)
        job_env = {cfg.RENDEZVOUS_ADDR: driver_ip, cfg.RENDEZVOUS_PORT: str(rounds.address[1]),
                   cfg.SECRET_KEY: key.hex(), cfg.JOB_ID: job_id,
                   cfg.CPU_OPERATIONS: "gloo", cfg.START_TIMEOUT: str(self.settings.timeout_s)}
        job_env.update(self._extra_env)
        job_env = elastic_env(job_env, self._elastic.elastic_timeout_s)
        discovery = RayNodeDiscovery(self._cpus, driver_node)
        driver = None

        def wake():
            if driver is not None:
                driver.wake()

        workers = RayWorkers(discovery, fn, args, kwargs, lambda: job_env, self._cpus,
                             driver_ip, wake)
        driver = Agent(self._elastic, discovery, workers, rounds)
        try:
            code = driver.run()
        finally:
            workers.stop_all()
            rounds.shutdown()
        if code != 0:
            why = "; ".join(f"{h}:{lr}: {w.splitlines()[0] if w else '?'}"
                            for (h, lr), w in workers.failures.items())
            raise HvdliteRayError(f"RayExecutor.run (elastic): the job failed with code {code}: "
                                  f"{driver.error or 'a worker failed'}"
                                  + (f" (worker failures: {why})" if why else ""))
        by_rank = sorted(driver.round_slots, key=lambda s: s.rank)
        return [workers.results.get((s.hostname, s.local_rank)) for s in by_rank]

    def run_remote(self, fn: Callable, args=None, kwargs: Optional[dict] = None) -> list:
        """Start ``fn(*args, **kwargs)`` on every rank without waiting.

        Args:
            fn: the function each rank runs.
            args: positional arguments for ``fn``.
            kwargs: keyword arguments for ``fn``.

        Returns:
            Ray object references, in rank order, for ``ray.get``.

        Raises:
            HvdliteRayError: not started.
        """
        self._check_started("run_remote")
        return [w.run.remote(fn, list(args or ()), dict(kwargs or {})) for w in self.workers]

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
        return self._gather([self.workers[0].execute.remote(fn)], "execute_single")[0]

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
