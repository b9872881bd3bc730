"""The driver service: task registration, routability probes, interface choice, worker exits.

Runs inside ``hvdlite-run`` when a job's workers start through task services
(``hvdlite.runner.starters.ssh_tasks``).  Each host's task connects,
registers its interfaces and its service port; the driver then has task *i*
probe task *i+1* (a ring) on every interface of the latter, keeps the
interfaces that worked everywhere (among those ``--network-interfaces`` names, when
given), and picks one for Gloo and for the rendezvous store.  During the run tasks report each
worker's exit here.  The driver and task services listen on all addresses (they
must be reachable before an interface is chosen) and authenticate every request;
the rendezvous store listens only on the chosen address.

Requests (all authenticated with the job key; each is idempotent):

* ``ping`` -> ``{role: "driver", job_id}``
* ``register {host_index, hostname, nics: {iface: [ipv4]}, port, driver_reachable: [iface]}``
* ``worker_exit {host_index, local_rank, code}`` (``rank`` may come too, unused): the
  worker is known by its slot (host, local slot), since its rank changes between rounds

The driver service starts empty and learns its hosts as the agent's rounds need
them (:meth:`DriverService.add_host`); a host whose task is started again (back
from the blacklist) gets a new index.
"""

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Set, Tuple

from hvdlite.common.exceptions import HvdliteError, HvdliteLaunchError
from hvdlite.common.net.service import Client, Service, ServiceError
from hvdlite.runner.tasks.nics import discover_nics, is_loopback

log = logging.getLogger(__name__)

#: tries per interface when choosing one: a lossy link may drop a first ping's SYNs
_PROBE_ATTEMPTS = 3


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ServiceError(f"malformed request: {what}")


@dataclasses.dataclass
class _Registration:
    hostname: str
    nics: Dict[str, List[str]]
    addr: str  # where the driver reaches the task (the registration's source)
    port: int
    driver_reachable: List[str]


class DriverService(Service):
    """Collects registrations and worker exits; wakes waiters on every change."""

    def __init__(
        self,
        key: bytes,
        job_id: str,
        bind_addr: str = "0.0.0.0",
        on_exit: Optional[Callable[[], None]] = None,
        **limits,
    ):
        self.job_id = job_id
        self.hostnames: List[str] = []
        self._on_exit = on_exit
        self.cond = threading.Condition()
        self.registrations: Dict[int, _Registration] = {}
        #: ((hostname, local slot), code) in the order the tasks reported them
        self.slot_exits: List[Tuple[Tuple[str, int], int]] = []
        super().__init__("driver", key, bind_addr, **limits)

    def add_host(self, hostname: str) -> int:
        """Make room for one more host's task; returns its host index."""
        with self.cond:
            self.hostnames.append(hostname)
            return len(self.hostnames) - 1

    def handle(self, header, blob, client):
        op = header.get("op")
        if op == "ping":
            return {"role": "driver", "job_id": self.job_id}, b""
        index = header.get("host_index")
        with self.cond:
            n_hosts = len(self.hostnames)
        _check(
            isinstance(index, int) and not isinstance(index, bool) and 0 <= index < n_hosts,
            "host_index out of range",
        )
        if op == "register":
            nics = header.get("nics")
            _check(
                isinstance(nics, dict)
                and all(
                    isinstance(k, str)
                    and isinstance(v, list)
                    and all(isinstance(a, str) for a in v)
                    for k, v in nics.items()
                ),
                "nics must map names to address lists",
            )
            port = header.get("port")
            _check(isinstance(port, int) and 0 < port < 65536, "port")
            reach = header.get("driver_reachable")
            _check(
                isinstance(reach, list) and all(isinstance(x, str) for x in reach),
                "driver_reachable",
            )
            hostname = header.get("hostname")
            _check(hostname == self.hostnames[index], "hostname does not match host_index")
            with self.cond:
                self.registrations[index] = _Registration(hostname, nics, client[0], port, reach)
                self.cond.notify_all()
            log.info(
                "task on %s registered from %s:%d (interfaces %s)",
                hostname,
                client[0],
                port,
                ", ".join(sorted(nics)),
            )
            return {}, b""
        if op == "worker_exit":
            local_rank, code = header.get("local_rank"), header.get("code")
            _check(
                isinstance(local_rank, int)
                and not isinstance(local_rank, bool)
                and local_rank >= 0,
                "local_rank",
            )
            _check(isinstance(code, int) and not isinstance(code, bool), "code")
            with self.cond:
                self.slot_exits.append(((self.hostnames[index], local_rank), code))
                self.cond.notify_all()
            if self._on_exit is not None:
                self._on_exit()
            return {}, b""
        raise ServiceError(f"unknown driver operation {op!r}")


class Driver:
    """The launcher's side of the task services: connections to them, interface choice."""

    def __init__(self, service: DriverService):
        self.key = service.key
        self.service = service
        self.nics = discover_nics()
        self._clients: Dict[int, Client] = {}

    @property
    def hostnames(self) -> List[str]:
        """Host names by host index (an elastic job's list grows)."""
        return self.service.hostnames

    def addresses(self) -> List[list]:
        """``[iface, ipv4, port]`` for every interface the tasks may try."""
        port = self.service.address[1]
        return [[name, addrs[0], port] for name, addrs in sorted(self.nics.items())]

    def wake(self) -> None:
        with self.service.cond:
            self.service.cond.notify_all()

    def client(self, index: int, timeout_s: float = 10.0) -> Client:
        """The connection to host ``index``'s task (made on first use)."""
        return self._client(index, timeout_s)

    def _client(self, index: int, timeout_s: float = 10.0) -> Client:
        if index not in self._clients:
            reg = self.service.registrations[index]
            self._clients[index] = Client(
                (reg.addr, reg.port), self.key, timeout_s, name=f"task service on {reg.hostname}"
            )
        return self._clients[index]

    def choose_interface(
        self,
        deadline: float,
        wanted: Optional[List[str]],
        verbose: bool = False,
        indices: Optional[List[int]] = None,
    ) -> Tuple[str, str]:
        """Probe the ring of tasks; return ``(interface, rendezvous address)``.

        ``indices``: the hosts to probe between (default: all; every one registered).

        Raises:
            HvdliteLaunchError: no interface (or none of ``wanted``) is routable
                between all hosts, or no driver address is reachable from all.
        """
        ring = list(range(len(self.hostnames))) if indices is None else list(indices)
        regs = {i: self.service.registrations[i] for i in ring}
        results = self._probe_ring(ring, regs, deadline, verbose)
        common = set.intersection(*results)
        driver_ok = set.intersection(*(set(r.driver_reachable) for r in regs.values()))
        candidates = sorted(common)
        if wanted:
            candidates = [w for w in wanted if w in common]
            if not candidates:
                raise HvdliteLaunchError(
                    f"--network-interfaces {','.join(wanted)}: none of them is routable between "
                    f"all hosts; routable: {sorted(common) or 'none'}; interfaces per host: "
                    + "; ".join(f"{r.hostname}: {sorted(r.nics)}" for r in regs.values())
                )
        if not candidates:
            n = len(ring)
            raise HvdliteLaunchError(
                "no network interface is routable between all hosts ("
                + "; ".join(
                    f"{self.hostnames[ring[p]]} -> {self.hostnames[ring[(p + 1) % n]]}: "
                    f"{sorted(r) or 'none'}"
                    for p, r in enumerate(results)
                )
                + "); check firewalls, or name one with --network-interfaces"
            )

        def rank_key(iface):
            # prefer a real interface the driver is reachable on, then any real one
            nics = regs[ring[0]].nics.get(iface, [])
            return (iface not in driver_ok, is_loopback(iface, nics), iface)

        iface = candidates[0] if wanted else sorted(candidates, key=rank_key)[0]
        return iface, self._store_address(iface, driver_ok)

    def _probe_ring(
        self, ring: List[int], regs: Dict[int, "_Registration"], deadline: float, verbose: bool
    ) -> List[set]:
        """Have each task probe the next one's interfaces; the reachable ones, per pair."""
        n = len(ring)

        def probe(pos):
            i, j = ring[pos], ring[(pos + 1) % n]
            targets = [
                [iface, addrs[0], regs[j].port] for iface, addrs in sorted(regs[j].nics.items())
            ]
            left = max(1.0, deadline - time.monotonic())
            each = min(3.0, left)
            wait = max(left, each * _PROBE_ATTEMPTS * len(targets)) + 5
            reply, _ = self._client(i, wait).request(
                {
                    "op": "probe",
                    "targets": targets,
                    "expect_host_index": j,
                    "timeout_s": each,
                    "attempts": _PROBE_ATTEMPTS,
                },
                timeout_s=wait,
            )
            return set(reply["reachable"])

        with ThreadPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(probe, range(n)))
        for pos, r in enumerate(results):
            i, j = ring[pos], ring[(pos + 1) % n]
            (log.warning if verbose else log.info)(
                "%s reaches %s on %s",
                self.hostnames[i],
                self.hostnames[j],
                sorted(r) or "no interface",
            )
        return results

    def cut_pairs(
        self,
        indices: List[int],
        iface: str,
        timeout_s: float = 2.0,
        involving: Optional[Set[int]] = None,
    ) -> List[Tuple[int, int]]:
        """The pairs ``(i, j)``, ``i < j``, of these hosts' tasks where one could not reach
        the other on ``iface`` just now (each task pings the others, on connections of its
        own, in parallel; ``involving``: only pairs with one of these).  A task the
        launcher cannot ask is left out: its own silence is the heartbeats' business, not
        a cut between two hosts."""
        regs = {
            i: self.service.registrations[i] for i in indices if i in self.service.registrations
        }
        wanted = set(regs) if involving is None else set(involving)

        def probe_from(i: int) -> Optional[Set[int]]:
            reg = regs[i]
            client = Client(
                (reg.addr, reg.port),
                self.key,
                timeout_s + 3.0,
                name=f"task service on {reg.hostname}",
            )
            failed = set()
            try:
                for j, other in regs.items():
                    addrs = other.nics.get(iface)
                    if j == i or not addrs or (i not in wanted and j not in wanted):
                        continue
                    reply, _ = client.request(
                        {
                            "op": "probe",
                            "targets": [[iface, addrs[0], other.port]],
                            "expect_host_index": j,
                            "timeout_s": timeout_s,
                        },
                        timeout_s=timeout_s + 3.0,
                    )
                    if iface not in reply.get("reachable", []):
                        failed.add(j)
            except (HvdliteError, OSError) as exc:
                log.info("reachability from %s not known: %s", reg.hostname, exc)
                return None
            finally:
                client.close()
            return failed

        with ThreadPoolExecutor(max_workers=max(1, len(regs))) as pool:
            found = dict(zip(regs, pool.map(probe_from, list(regs))))
        pairs = {(min(i, j), max(i, j)) for i, failed in found.items() if failed for j in failed}
        return sorted(pairs)

    def _store_address(self, iface: str, driver_ok: set) -> str:
        """This host's address for the rendezvous store: on ``iface`` when every task
        reaches the driver there, else on another interface they all reach.

        Raises:
            HvdliteLaunchError: no address of this host is reachable from all hosts.
        """
        if iface in driver_ok and iface in self.nics:
            return self.nics[iface][0]
        usable = sorted(driver_ok & set(self.nics), key=lambda x: (is_loopback(x, self.nics[x]), x))
        if not usable:
            raise HvdliteLaunchError(
                "no address of this host is reachable from all hosts for the rendezvous "
                "store (check firewalls)"
            )
        return self.nics[usable[0]][0]

    def shutdown(self) -> None:
        for c in self._clients.values():
            c.close()
        self.service.shutdown()
