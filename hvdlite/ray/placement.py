"""Where the ranks of a Ray job go: one placement group, then ranks grouped by node."""

from typing import Dict, List, Sequence

from hvdlite.runner.hosts import HostSlots, SlotInfo, assign_slots


def bundles(num_workers: int, num_hosts: int, workers_per_host: int,
            cpus_per_worker: float) -> List[Dict[str, float]]:
    """The placement group's bundles: one per worker, or one per host holding its
    workers' CPUs (so Ray must put a host's ranks on one node)."""
    if num_hosts:
        return [{"CPU": float(cpus_per_worker) * workers_per_host}] * num_hosts
    return [{"CPU": float(cpus_per_worker)}] * num_workers


def slots_by_node(nodes: Sequence[str]) -> List[SlotInfo]:
    """Slot i for the worker that runs on ``nodes[i]``: ranks numbered host by host in the
    order the nodes first appear, as the SSH launcher numbers a host list, so ranks of one
    node are consecutive and share local/cross ranks the same way.
    """
    order: List[str] = []
    for n in nodes:
        if n not in order:
            order.append(n)
    hosts = [HostSlots(hostname=n, slots=nodes.count(n)) for n in order]
    by_host: Dict[str, List[SlotInfo]] = {}
    for slot in assign_slots(hosts, len(nodes)):
        by_host.setdefault(slot.hostname, []).append(slot)
    taken = {n: 0 for n in order}
    out = []
    for n in nodes:
        out.append(by_host[n][taken[n]])
        taken[n] += 1
    return out
