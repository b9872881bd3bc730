"""Host lists and slot assignment: which rank runs where.

Ranks fill hosts in the order given, each host up to its slot count; local
ranks count within a host, cross ranks count hosts that have that local rank.
A host is written ``[user@]name[:slots]`` on ``-H``; a hostfile line is either
Open MPI's ``[user@]name slots=N`` or MPICH / Intel MPI's ``[user@]name:N`` (the
form Kubeflow's MPIJob writes depends on the MPI it was set up for).
"""

import dataclasses
import functools
import socket
from typing import Dict, List, Optional, Sequence, Set, Tuple

import psutil

from hvdlite.common.exceptions import HvdliteConfigError


@dataclasses.dataclass(frozen=True)
class HostSlots:
    hostname: str
    slots: int
    user: Optional[str] = None

    @property
    def ssh_target(self) -> str:
        return f"{self.user}@{self.hostname}" if self.user else self.hostname


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
    #: the host's place among the job's hosts (in order of first appearance), and their
    #: number: torchrun's GROUP_RANK and GROUP_WORLD_SIZE
    host_index: int = 0
    host_count: int = 1


#: (host name, local rank): how the agent, the starters and the store name one worker
#: process for its whole life, whatever rank later rounds give it
SlotId = Tuple[str, int]


def slot_id(slot: SlotInfo) -> SlotId:
    """The :data:`SlotId` of ``slot``."""
    return (slot.hostname, slot.local_rank)


def host_name_problem(host: str) -> Optional[str]:
    """Why ``host`` cannot be a host name, or None.

    A name starting with ``-`` would reach ``ssh`` or a ``--launcher-agent`` as an
    option (``-oProxyCommand=...`` runs a command here); no DNS name starts with one
    (RFC 1123).  A non-printable character would be echoed raw into the log.
    """
    if host.startswith("-"):
        return "a host name cannot start with '-' (it would be read as an option)"
    if not host.isprintable():
        return "a host name cannot contain non-printable characters"
    return None


def _split_user(name: str, where: str):
    """``[user@]host`` -> (host, user or None), both checked.

    Raises:
        HvdliteConfigError: an empty part, or a name that could pass as an option.
    """
    user, sep, host = name.rpartition("@")
    if sep and (not user or not host):
        raise HvdliteConfigError(f"{where}: {name!r} is not [user@]host")
    host, user = (host, user or None) if sep else (name, None)
    for part in (host, user):
        problem = part and host_name_problem(part)
        if problem:
            raise HvdliteConfigError(f"{where}: {problem.replace('host name', 'name')}")
    return host, user


def parse_hosts(spec: str) -> List[HostSlots]:
    """Parse ``-H host1:2,user@host2:1`` (a host without ``:N`` has 1 slot).

    Raises:
        HvdliteConfigError: an entry has no name, or its slots are not a positive number.
    """
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        if not name:
            raise HvdliteConfigError(f"-H/--hosts: entry {item!r} has no host name")
        try:
            count = int(slots)
        except ValueError:
            raise HvdliteConfigError(
                f"-H/--hosts: entry {item!r}: slots {slots!r} is not a number"
            ) from None
        if count < 1:
            raise HvdliteConfigError(f"-H/--hosts: entry {item!r}: slots must be at least 1")
        host, user = _split_user(name, f"-H/--hosts entry {item!r}")
        hosts.append(HostSlots(host, count, user))
    if not hosts:
        raise HvdliteConfigError(f"-H/--hosts: no hosts in {spec!r}")
    return merge_hosts(hosts, "-H/--hosts")


def parse_hostfile(path: str) -> List[HostSlots]:
    """Parse a hostfile: ``host slots=N`` (Open MPI) or ``host:N`` (MPICH, Intel MPI) per
    line, ``#`` comments, blank lines.

    A line with just a host name has 1 slot.

    Raises:
        HvdliteConfigError: the file cannot be read or a line is malformed (the
            message names file and line number).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise HvdliteConfigError(f"--hostfile {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise HvdliteConfigError(f"--hostfile {path}: {_undecodable(exc)}") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--hostfile {path}, line {number} ({raw.strip()!r})"
        fields = line.split()
        if len(fields) > 2:
            raise HvdliteConfigError(f"{where}: expected 'host slots=N' or 'host:N'")
        count = 1
        if len(fields) == 1 and ":" in fields[0]:
            fields[0], count = _colon_slots(fields[0], where)
        if len(fields) == 2:
            key, sep, value = fields[1].partition("=")
            if key not in ("slots", "max_slots") or not sep:
                raise HvdliteConfigError(f"{where}: expected 'slots=N' after the host name")
            count = _slot_count(value, where)
        if ":" in fields[0] or "=" in fields[0]:
            raise HvdliteConfigError(f"{where}: expected 'host slots=N' or 'host:N'")
        host, user = _split_user(fields[0], where)
        hosts.append(HostSlots(host, count, user))
    if not hosts:
        raise HvdliteConfigError(f"--hostfile {path}: no hosts in the file")
    return merge_hosts(hosts, f"--hostfile {path}")


def _undecodable(exc: UnicodeDecodeError) -> str:
    """Where a file stops being UTF-8 text: its line and the byte, for the message."""
    line = exc.object[: exc.start].count(b"\n") + 1
    return (
        f"line {line} is not UTF-8 text (byte {exc.object[exc.start : exc.start + 1]!r}); "
        f"expected one host per line"
    )


def _colon_slots(field: str, where: str) -> Tuple[str, int]:
    """``name:N`` -> (name, N) for a hostfile line in the MPICH form."""
    name, _, value = field.rpartition(":")
    return name, _slot_count(value, where)


def _slot_count(value: str, where: str) -> int:
    """A hostfile line's slot count.

    Raises:
        HvdliteConfigError: not a number, or below 1 (names the file and line).
    """
    try:
        count = int(value)
    except ValueError:
        raise HvdliteConfigError(f"{where}: slots {value!r} is not a number") from None
    if count < 1:
        raise HvdliteConfigError(f"{where}: slots must be at least 1")
    return count


def merge_hosts(hosts: List[HostSlots], where: str) -> List[HostSlots]:
    """A host listed twice gets the sum of its slots (at its first position).

    Every host source ends here, so the names are checked here too.

    Raises:
        HvdliteConfigError: two login names for one host, or a name that could pass as
            an option (names ``where`` and the host).
    """
    order, merged = [], {}
    for h in hosts:
        for part in (h.hostname, h.user):
            problem = part and host_name_problem(part)
            if problem:
                raise HvdliteConfigError(f"{where}: {part!r}: {problem}")
        key = h.hostname
        if key in merged:
            if merged[key].user != h.user:
                raise HvdliteConfigError(f"{where}: host {h.hostname!r} listed with two users")
            merged[key] = HostSlots(h.hostname, merged[key].slots + h.slots, h.user)
        else:
            order.append(key)
            merged[key] = h
    return [merged[k] for k in order]


def assign_slots(hosts: List[HostSlots], np: int) -> List[SlotInfo]:
    """Give ranks 0..np-1 their host, local and cross ranks.

    Raises:
        HvdliteConfigError: ``np`` < 1, or the hosts have fewer slots than ``np``.
    """
    if np < 1:
        raise HvdliteConfigError(f"-np {np}: the number of processes must be at least 1")
    total = sum(h.slots for h in hosts)
    if np > total:
        listing = ", ".join(f"{h.hostname}:{h.slots}" for h in hosts)
        raise HvdliteConfigError(
            f"-np {np} asks for more processes than the {total} slots of the "
            f"hosts ({listing}); add hosts or slots, or lower -np"
        )
    placed = []  # (hostname, local_rank)
    for host in hosts:
        for local in range(host.slots):
            if len(placed) == np:
                break
            placed.append((host.hostname, local))
    return place_slots(placed)


def hosts_used(hosts: List[HostSlots], np: int) -> List[HostSlots]:
    """The hosts a static job of ``np`` ranks uses, each with the slots its ranks take,
    filled host by host (what :func:`assign_slots` places).

    Raises:
        HvdliteConfigError: as :func:`assign_slots`.
    """
    used: Dict[str, int] = {}
    for slot in assign_slots(hosts, np):
        used[slot.hostname] = used.get(slot.hostname, 0) + 1
    return [HostSlots(h.hostname, used[h.hostname], h.user) for h in hosts if h.hostname in used]


def place_slots(placed: Sequence[Tuple[str, int]]) -> List[SlotInfo]:
    """Rank ``i`` runs on ``placed[i]`` = (host, slot); add the size, local and cross ranks.

    The static launcher places ranks host by host; the agent keeps its survivors'
    order and appends new slots, so a host's ranks need not be contiguous, and after
    a slot was blacklisted a host's slots need not be 0..k-1 either.  Local ranks are
    dense all the same: a host's slots, in slot order, get local ranks 0..k-1.  Cross
    ranks count, in order of first appearance, the hosts that have that local rank; host
    indices count every host in that order.
    """
    by_host: Dict[str, List[int]] = {}
    for name, slot in placed:
        by_host.setdefault(name, []).append(slot)
    dense = {
        (name, slot): i for name, slots in by_host.items() for i, slot in enumerate(sorted(slots))
    }
    hosts_with_local: Dict[int, List[str]] = {}
    for name, slot in placed:
        hosts_with_local.setdefault(dense[(name, slot)], []).append(name)
    host_order = list(by_host)  # dicts keep the order of first appearance
    result = []
    for rank, (name, slot) in enumerate(placed):
        local = dense[(name, slot)]
        peers = hosts_with_local[local]
        result.append(
            SlotInfo(
                hostname=name,
                rank=rank,
                local_rank=local,
                cross_rank=peers.index(name),
                size=len(placed),
                local_size=len(by_host[name]),
                cross_size=len(peers),
                host_index=host_order.index(name),
                host_count=len(host_order),
            )
        )
    return result


@functools.lru_cache(maxsize=1)
def local_addresses() -> Set[str]:
    """Names and addresses that mean "this machine"."""
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                names.add(a.address.split("%", 1)[0])
    return names


def resolve(hostname: str) -> str:
    """The host's first IPv4 address.

    Raises:
        HvdliteConfigError: the name does not resolve (names the host).
    """
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise HvdliteConfigError(
            f"unknown host {hostname!r}: it does not resolve ({exc}); check -H/--hostfile "
            f"and DNS or /etc/hosts"
        ) from None
    return infos[0][4][0]


def is_local(hostname: str) -> bool:
    """True for localhost, this host's names and any address of its interfaces.

    A name is local when it, or the address it resolves to, is one of ours;
    ``127.0.0.2`` is not (no interface has it), so it is reached through SSH.
    """
    mine = local_addresses()
    if hostname in mine:
        return True
    try:
        return resolve(hostname) in mine and hostname not in ("",)
    except HvdliteConfigError:
        return False


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
