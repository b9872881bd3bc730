"""Where the ranks of a Ray job go: one placement group (ranks are then numbered node by
node with ``hvdlite.runner.hosts.slots_by_node``)."""

from typing import Dict, List


def bundles(
    num_workers: int, num_hosts: int, workers_per_host: int, cpus_per_worker: float
) -> List[Dict[str, float]]:
    """The placement group's bundles: one per worker, or one per host holding its
    workers' CPUs (so Ray must put a host's ranks on one node)."""
    if num_hosts:
        return [{"CPU": float(cpus_per_worker) * workers_per_host}] * num_hosts
    return [{"CPU": float(cpus_per_worker)}] * num_workers
