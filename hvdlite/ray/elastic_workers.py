"""Elastic jobs on Ray: Ray's nodes as the job's hosts and Ray actors as its workers.

The job runs through ``hvdlite.runner.agent.job.run_job`` like ``hvdlite-run
--min-np``'s; only its two ports change.  :class:`RayNodeHosts`
answers which hosts exist: every live Ray node, with as many slots as it has CPUs for
workers.  :class:`RayActorStarter` starts a worker as an actor pinned to its slot's node,
runs the user's function in it, and reports the function's end as an exit (0 when it
returned, 1 when it raised, 137 when the actor or its node died).
"""

import logging
from typing import Callable, Dict, List, Sequence

from hvdlite.ray.calls import ActorCallStarter
from hvdlite.ray.worker import RankWorker
from hvdlite.runner.hosts import HostSlots, SlotId, SlotInfo, slot_id
from hvdlite.runner.hosts.source import HostDiscoveryError, HostSource
from hvdlite.runner.processes.workers import slot_env

log = logging.getLogger(__name__)


class RayNodeHosts(HostSource):
    """The live Ray nodes, each with ``CPU // cpus_per_worker`` slots; the driver's node
    first, the others in a stable order."""

    def __init__(self, cpus_per_worker: float, driver_node: str):
        self._cpus = cpus_per_worker
        self._driver_node = driver_node
        self._names: Dict[str, str] = {}  # node id -> host name, stable for the job
        self.node_of: Dict[str, str] = {}  # host name -> node id (for pinning actors)
        self.address_of: Dict[str, str] = {}

    def find(self) -> List[HostSlots]:
        import ray

        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
        except Exception as exc:
            raise HostDiscoveryError(f"Ray's node list is unavailable: {exc}") from exc
        # a node keeps the name it was first given (the driver knows workers by it): a later
        # node on an address already named gets the address plus its short id
        nodes.sort(key=lambda n: (n["NodeID"] != self._driver_node, n["NodeID"]))
        for n in nodes:
            node = n["NodeID"]
            if node not in self._names:
                taken = set(self._names.values())
                ip = n["NodeManagerAddress"]
                self._names[node] = ip if ip not in taken else f"{ip}-{node[:8]}"
        names = self._names
        hosts = []
        for n in nodes:  # the driver's node first
            slots = int(n.get("Resources", {}).get("CPU", 0) // self._cpus)
            if slots < 1:
                continue
            name = names[n["NodeID"]]
            self.node_of[name] = n["NodeID"]
            self.address_of[name] = n["NodeManagerAddress"]
            hosts.append(HostSlots(hostname=name, slots=slots))
        return hosts


class RayActorStarter(ActorCallStarter):
    """Workers as actors pinned to their slot's node, each running the user's function; the
    watching, stopping and exits are :class:`~hvdlite.ray.calls.ActorCallStarter`'."""

    def __init__(
        self,
        discovery: RayNodeHosts,
        fn: Callable,
        args,
        kwargs,
        job_env: Callable[[], Dict[str, str]],
        cpus_per_worker: float,
        on_exit: Callable[[], None],
    ):
        args, kwargs = list(args or ()), dict(kwargs or {})
        super().__init__(
            {}, lambda actor, env: actor.run.remote(fn, args, kwargs, env), job_env, on_exit
        )
        self._discovery = discovery
        self._cpus = cpus_per_worker

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        """A new actor on each slot's node, set up with its environment, then the call."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        failed: Dict[SlotId, str] = {}
        env = self._job_env()
        actor = ray.remote(RankWorker)
        for slot in slots:
            sid = slot_id(slot)
            node = self._discovery.node_of.get(slot.hostname)
            if node is None:
                failed[sid] = f"no Ray node is known as {slot.hostname}"
                continue
            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
            worker = actor.options(num_cpus=self._cpus, scheduling_strategy=strategy).remote()
            worker.setup.remote(self._discovery.address_of.get(slot.hostname, ""))
            self._track(sid, worker, slot_env(slot, {}, env))
        return failed
