"""The driver service: task registration, routability probes, interface choice, worker exits.

Runs inside ``hvdlite-run`` for multi-host jobs.  Each host's task connects,
registers its interfaces and its service port; the driver then has task *i*
probe task *i+1* (a ring) on every interface of the latter, keeps the
interfaces that worked everywhere, and picks one for Gloo and for the
rendezvous store.  During the run tasks report each worker's exit here.

Requests (all authenticated with the job key; each is idempotent):

* ``ping`` -> ``{role: "driver", job_id}``
* ``register {host_index, hostname, nics: {iface: [ipv4]}, port, driver_reachable: [iface]}``
* ``worker_exit {host_index, rank, code}``; in an elastic job also ``local_rank``: the
  worker is known by its slot (host, local rank), since its rank changes between rounds

An elastic job's driver service starts empty and learns its hosts as discovery
finds them (:meth:`DriverService.add_host`); a host whose task is started again
(back from the blacklist) gets a new index.
"""

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

from hvdlite.common.exceptions import HvdliteError, HvdliteLaunchError, HvdliteTimeoutError
from hvdlite.common.net.service import Client, Service, ServiceError
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.nics import discover_nics, is_loopback
from hvdlite.runner.procs import exit_status, failure_message

log = logging.getLogger(__name__)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ServiceError(f"malformed request: {what}")


@dataclasses.dataclass
class _Registration:
    hostname: str
    nics: Dict[str, List[str]]
    addr: str          # where the driver reaches the task (the registration's source)
    port: int
    driver_reachable: List[str]


class DriverService(Service):
    """Collects registrations and worker exits; wakes waiters on every change."""

    def __init__(self, key: bytes, job_id: str, hostnames: List[str],
                 ranks_by_host: List[List[int]], bind_addr: str = "0.0.0.0",
                 elastic: bool = False, on_exit: Optional[Callable[[], None]] = None,
                 **limits):
        self.job_id = job_id
        self.hostnames = list(hostnames)
        self._ranks_by_host = [set(r) for r in ranks_by_host]
        self.elastic = elastic
        self._on_exit = on_exit
        self.cond = threading.Condition()
        self.registrations: Dict[int, _Registration] = {}
        self.exits: Dict[int, int] = {}
        self.exit_order: List[int] = []
        #: elastic jobs: ((hostname, local_rank), code) in the order the tasks reported them
        self.slot_exits: List[Tuple[Tuple[str, int], int]] = []
        super().__init__("driver", key, bind_addr,
                         expected_peers=sum(len(r) for r in ranks_by_host) + len(hostnames),
                         **limits)

    def add_host(self, hostname: str) -> int:
        """Make room for one more host's task (elastic jobs); returns its host index."""
        with self.cond:
            self.hostnames.append(hostname)
            self._ranks_by_host.append(set())
            return len(self.hostnames) - 1

    def handle(self, header, blob, client):
        op = header.get("op")
        if op == "ping":
            return {"role": "driver", "job_id": self.job_id}, b""
        index = header.get("host_index")
        with self.cond:
            n_hosts = len(self.hostnames)
        _check(isinstance(index, int) and not isinstance(index, bool)
               and 0 <= index < n_hosts, "host_index out of range")
        if op == "register":
            nics = header.get("nics")
            _check(isinstance(nics, dict) and all(
                isinstance(k, str) and isinstance(v, list) and all(isinstance(a, str) for a in v)
                for k, v in nics.items()), "nics must map names to address lists")
            port = header.get("port")
            _check(isinstance(port, int) and 0 < port < 65536, "port")
            reach = header.get("driver_reachable")
            _check(isinstance(reach, list) and all(isinstance(x, str) for x in reach),
                   "driver_reachable")
            hostname = header.get("hostname")
            _check(hostname == self.hostnames[index], "hostname does not match host_index")
            with self.cond:
                self.registrations[index] = _Registration(hostname, nics, client[0], port, reach)
                self.cond.notify_all()
            log.info("task on %s registered from %s:%d (interfaces %s)", hostname, client[0],
                     port, ", ".join(sorted(nics)))
            return {}, b""
        if op == "worker_exit" and self.elastic:
            local_rank, code = header.get("local_rank"), header.get("code")
            _check(isinstance(local_rank, int) and not isinstance(local_rank, bool)
                   and local_rank >= 0, "local_rank")
            _check(isinstance(code, int) and not isinstance(code, bool), "code")
            with self.cond:
                self.slot_exits.append(((self.hostnames[index], local_rank), code))
                self.cond.notify_all()
            if self._on_exit is not None:
                self._on_exit()
            return {}, b""
        if op == "worker_exit":
            rank, code = header.get("rank"), header.get("code")
            _check(isinstance(rank, int) and rank in self._ranks_by_host[index],
                   "rank does not run on that host")
            _check(isinstance(code, int) and not isinstance(code, bool), "code")
            with self.cond:
                if rank not in self.exits:
                    self.exits[rank] = code
                    self.exit_order.append(rank)
                self.cond.notify_all()
            return {}, b""
        raise ServiceError(f"unknown driver operation {op!r}")


class Driver:
    """The launcher's side of a multi-host job."""

    def __init__(self, key: bytes, job_id: str, hostnames: List[str],
                 slots_by_host: List[List[SlotInfo]], service: Optional[DriverService] = None):
        self.key = key
        self.slots_by_host = slots_by_host
        self.service = service or DriverService(key, job_id, hostnames,
                                                [[s.rank for s in ss] for ss in slots_by_host])
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
            self._clients[index] = Client((reg.addr, reg.port), self.key, timeout_s,
                                          name=f"task service on {reg.hostname}")
        return self._clients[index]

    def wait_for_tasks(self, deadline: float, tasks, stop: threading.Event) -> None:
        """Block until every host's task registered.

        Raises:
            HvdliteTimeoutError: some did not within --start-timeout (names them).
            HvdliteLaunchError: a task exited before registering (names the host).
        """
        svc = self.service
        with svc.cond:
            while len(svc.registrations) < len(self.hostnames) and not stop.is_set():
                for i, t in enumerate(tasks):
                    code = t.poll()
                    if i not in svc.registrations and code is not None:
                        raise HvdliteLaunchError(
                            f"the task on host {self.hostnames[i]} exited with code {code} "
                            f"before registering with the driver (see its messages above)")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [h for i, h in enumerate(self.hostnames)
                               if i not in svc.registrations]
                    raise HvdliteTimeoutError(
                        f"the tasks on hosts {missing} did not register with the driver within "
                        f"--start-timeout; they could not reach it at any of "
                        f"{[a[:2] for a in self.addresses()]} (a firewall?), or start slowly "
                        f"(raise --start-timeout)")
                svc.cond.wait(min(left, 0.2))
        if stop.is_set():
            raise HvdliteError("interrupted")

    def choose_interface(self, deadline: float, wanted: Optional[List[str]],
                         verbose: bool = False,
                         indices: Optional[List[int]] = None) -> Tuple[str, str]:
        """Probe the ring of tasks; return ``(interface, rendezvous address)``.

        ``indices``: the hosts to probe between (default: all; every one registered).

        Raises:
            HvdliteLaunchError: no interface (or none of ``wanted``) is routable
                between all hosts, or no driver address is reachable from all.
        """
        all_regs = self.service.registrations
        ring = list(range(len(self.hostnames))) if indices is None else list(indices)
        regs = {i: all_regs[i] for i in ring}
        n = len(ring)

        def probe(pos):
            i, j = ring[pos], ring[(pos + 1) % n]
            targets = [[iface, addrs[0], regs[j].port] for iface, addrs in
                       sorted(regs[j].nics.items())]
            left = max(1.0, deadline - time.monotonic())
            reply, _ = self._client(i, left + 5).request(
                {"op": "probe", "targets": targets, "expect_host_index": j,
                 "timeout_s": min(3.0, left)}, timeout_s=left + 5)
            return set(reply["reachable"])

        with ThreadPoolExecutor(max_workers=n) as pool:
            results = list(pool.map(probe, range(n)))
        common = set.intersection(*results)
        for pos, r in enumerate(results):
            i, j = ring[pos], ring[(pos + 1) % n]
            msg = "%s reaches %s on %s"
            args = (self.hostnames[i], self.hostnames[j], sorted(r) or "no interface")
            (log.warning if verbose else log.info)(msg, *args)
        driver_ok = set.intersection(*(set(r.driver_reachable) for r in regs.values()))
        candidates = sorted(common)
        if wanted:
            candidates = [w for w in wanted if w in common]
            if not candidates:
                raise HvdliteLaunchError(
                    f"--network-interfaces {','.join(wanted)}: none of them is routable between "
                    f"all hosts; routable: {sorted(common) or 'none'}; interfaces per host: "
                    + "; ".join(f"{r.hostname}: {sorted(r.nics)}" for r in regs.values()))
        if not candidates:
            raise HvdliteLaunchError(
                "no network interface is routable between all hosts ("
                + "; ".join(f"{self.hostnames[ring[p]]} -> {self.hostnames[ring[(p + 1) % n]]}: "
                            f"{sorted(r) or 'none'}" for p, r in enumerate(results))
                + "); check firewalls, or name one with --network-interfaces")

        def rank_key(iface):
            # prefer a real interface the driver is reachable on, then any real one
            nics = regs[ring[0]].nics.get(iface, [])
            return (iface not in driver_ok, is_loopback(iface, nics), iface)

        iface = candidates[0] if wanted else sorted(candidates, key=rank_key)[0]
        if iface in driver_ok and iface in self.nics:
            rdv = self.nics[iface][0]
        else:
            usable = sorted(driver_ok & set(self.nics),
                            key=lambda x: (is_loopback(x, self.nics[x]), x))
            if not usable:
                raise HvdliteLaunchError(
                    "no address of this host is reachable from all hosts for the rendezvous "
                    "store (check firewalls)")
            rdv = self.nics[usable[0]][0]
        return iface, rdv

    def run_workers(self, command: List[str], job_env: Dict[str, str], deadline: float) -> None:
        """Have every task start its workers.

        Raises:
            HvdliteLaunchError: a task could not start them (names the host and reason).
        """

        def run(i):
            slots = [dataclasses.asdict(s) for s in self.slots_by_host[i]]
            try:
                self._client(i).request({"op": "run", "slots": slots, "command": command,
                                         "env": job_env},
                                        timeout_s=max(5.0, deadline - time.monotonic()))
            except (ServiceError, ConnectionError, HvdliteTimeoutError) as exc:
                raise HvdliteLaunchError(
                    f"starting workers on host {self.hostnames[i]} failed: {exc}") from None

        with ThreadPoolExecutor(max_workers=len(self.hostnames)) as pool:
            list(pool.map(run, range(len(self.hostnames))))

    def wait_for_workers(self, tasks, stop: threading.Event,
                         op_timeout_s: Optional[float] = None) -> Tuple[Optional[str], int]:
        """Wait until every rank exited 0, one failed, a task died, or ``stop`` is set.

        Returns ``(failure message or None, exit code)``.  The message names first a rank
        that exited 0 before its peers finished, or one that a task reports stopped
        (``op_timeout_s``: how long its peers waited for it), then the rank that failed.
        """
        svc = self.service
        size = sum(len(s) for s in self.slots_by_host)
        host_of = {s.rank: s.hostname for ss in self.slots_by_host for s in ss}
        dead_since: Dict[int, float] = {}
        failed = None
        with svc.cond:
            while not stop.is_set():
                early = None                   # a rank that exited 0 before one failed
                for rank in svc.exit_order:
                    code = svc.exits[rank]
                    if code == 0 and early is None:
                        early = (rank, host_of[rank])
                    if code != 0:
                        failed = (rank, code, early)
                        break
                if failed is not None:
                    break
                if len(svc.exits) == size:
                    return None, 0
                for i, t in enumerate(tasks):
                    code = t.poll()
                    pending = [s.rank for s in self.slots_by_host[i] if s.rank not in svc.exits]
                    if code is not None and pending:
                        # a report may still be in flight; give it a moment
                        first = dead_since.setdefault(i, time.monotonic())
                        if time.monotonic() - first > 2.0:
                            return (f"hvdlite-run: the task on host {self.hostnames[i]} ended "
                                    f"(code {code}; connection lost?) before ranks {pending} "
                                    f"finished; the other ranks were terminated.\n", 1)
                svc.cond.wait(0.2)
        if failed is None:
            return None, 130
        rank, code, early = failed
        silent = self._stopped_rank()         # asked outside the lock: tasks answer on it
        stopped = (silent, host_of[silent]) if silent is not None else None
        return (failure_message(rank, host_of[rank], code, left_early=early, stopped=stopped,
                                op_timeout_s=op_timeout_s), exit_status(code))

    def _stopped_rank(self, timeout_s: float = 3.0) -> Optional[int]:
        """A rank whose process its task sees stopped (SIGSTOP, a debugger), if any."""
        for i in sorted(self.service.registrations):
            try:
                reply, _ = self._client(i, timeout_s).request({"op": "stopped"},
                                                              timeout_s=timeout_s)
            except (HvdliteError, OSError) as exc:
                log.info("stopped ranks on %s: %s", self.hostnames[i], exc)
                continue
            ranks = reply.get("ranks")
            if isinstance(ranks, list) and ranks and isinstance(ranks[0], int):
                return ranks[0]
        return None

    def terminate_all(self, timeout_s: float) -> None:
        """Ask every registered task to end its workers (best effort, bounded)."""
        indices = list(self.service.registrations)
        if not indices:
            return

        def term(i):
            try:
                self._client(i, timeout_s).request({"op": "terminate"}, timeout_s=timeout_s)
            except (HvdliteError, OSError) as exc:
                log.info("terminate on %s: %s", self.hostnames[i], exc)

        with ThreadPoolExecutor(max_workers=len(indices)) as pool:
            list(pool.map(term, indices))

    def shutdown(self) -> None:
        for c in self._clients.values():
            c.close()
        self.service.shutdown()
