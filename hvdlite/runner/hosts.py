"""Host lists and slot assignment: which rank runs where.

Ranks fill hosts in the order given, each host up to its slot count; local
ranks count within a host, cross ranks count hosts that have that local rank.
"""

import dataclasses
from typing import List


@dataclasses.dataclass(frozen=True)
class HostSlots:
    hostname: str
    slots: int


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the job's rank vocabulary."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def parse_hosts(spec: str) -> List[HostSlots]:
    """Parse ``-H host1:2,host2:1`` (a host without ``:N`` has 1 slot)."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        if not name:
            raise ValueError(f"-H/--hosts: entry {item!r} has no host name")
        try:
            count = int(slots)
        except ValueError:
            raise ValueError(f"-H/--hosts: entry {item!r}: slots {slots!r} is not a number") \
                from None
        if count < 1:
            raise ValueError(f"-H/--hosts: entry {item!r}: slots must be at least 1")
        hosts.append(HostSlots(name, count))
    if not hosts:
        raise ValueError(f"-H/--hosts: no hosts in {spec!r}")
    return hosts


def assign_slots(hosts: List[HostSlots], np: int) -> List[SlotInfo]:
    """Give ranks 0..np-1 their host, local and cross ranks.

    Raises ValueError if the hosts have fewer slots than ``np``.
    """
    if np < 1:
        raise ValueError(f"-np {np}: the number of processes must be at least 1")
    total = sum(h.slots for h in hosts)
    if np > total:
        listing = ", ".join(f"{h.hostname}:{h.slots}" for h in hosts)
        raise ValueError(f"-np {np} asks for more processes than the {total} slots of the "
                         f"hosts ({listing}); add hosts or slots, or lower -np")
    placed = []          # (hostname, local_rank)
    for host in hosts:
        for local in range(host.slots):
            if len(placed) == np:
                break
            placed.append((host.hostname, local))
    local_sizes = {}
    for name, _ in placed:
        local_sizes[name] = local_sizes.get(name, 0) + 1
    # cross_rank: index of this host among hosts that have this local_rank
    host_order = list(dict.fromkeys(name for name, _ in placed))
    result = []
    for rank, (name, local) in enumerate(placed):
        peers = [h for h in host_order if local_sizes[h] > local]
        result.append(SlotInfo(hostname=name, rank=rank, local_rank=local,
                               cross_rank=peers.index(name), size=np,
                               local_size=local_sizes[name], cross_size=len(peers)))
    return result
