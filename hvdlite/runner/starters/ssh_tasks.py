"""The task-service starter: workers through a task service on every host.

The launcher runs the driver service (``runner/tasks/driver_service.py``); each
host runs a task service (``runner/tasks/task_service.py``), started over SSH
(``runner/tasks/ssh.py``), or as a local subprocess for this machine.  A host gets its
task the first time a round needs it; the task registers with the driver service,
and its ``run`` request is sent again whenever a round adds slots on that host;
``stop`` ends given slots.  Tasks report each worker's exit by its slot (host, local
slot).

Every registered task is pinged once a second (``runner/tasks/heartbeats.py``): a host
silent for ``UNREACHABLE_S`` has its workers reported lost (exit :data:`TASK_LOST_CODE`,
255), is never waited for at the end, and the failure summary names it rather than the
ranks that merely noticed it was gone.  Its task is cut off and forgotten: a host that
comes back (an elastic job's cooldown) gets a new task.

The interface Gloo and the rendezvous store use is chosen once, by probing between
the hosts of the first round; a host that joins later must have an interface of that
name, or it is refused (and blacklisted) with a message that says so.
"""

import dataclasses
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteError, HvdliteLaunchError
from hvdlite.runner.hosts import HostSlots, SlotInfo, is_local
from hvdlite.runner.processes.workers import OutputTarget, describe_exit
from hvdlite.runner.tasks.driver_service import Driver, DriverService
from hvdlite.runner.tasks.ssh import SSHOptions, TaskProcess, start_task
from hvdlite.runner.tasks import heartbeats as task_heartbeats
from hvdlite.runner.hosts import SlotId, slot_id
from hvdlite.runner.starters.base import Starter

log = logging.getLogger(__name__)

#: the exit code reported for workers whose task vanished (connection lost, host gone)
TASK_LOST_CODE = 255
#: how long a dead task's last exit reports may take before its workers count as lost
TASK_LOST_GRACE_S = 2.0
#: bound on one ``stop`` or ``terminate`` request to a task
TASK_REQUEST_S = 10.0
#: how long tasks get to end their workers at the end of the job before we cut them off
TASK_SHUTDOWN_GRACE_S = 10.0


@dataclasses.dataclass
class _HostTask:
    hostname: str
    index: int
    task: TaskProcess


class TaskStarter(Starter):
    """Starts and stops workers through one task per host.

    ``job_env`` is called at each start (the rendezvous store exists only once
    the first round is published); ``forward_env`` is the allow-listed environment
    every host's workers get; ``sink`` takes the rank lines of every task's output.
    """

    def __init__(self, key: bytes, job_id: str, command: Sequence[str],
                 job_env: Callable[[], Dict[str, str]], forward_env: Dict[str, str],
                 ssh: SSHOptions, start_timeout_s: float, sink: OutputTarget,
                 network_interfaces: Optional[List[str]] = None,
                 on_exit: Callable[[], None] = lambda: None, verbose: bool = False,
                 open_task: Optional[Callable[[HostSlots, bool, dict, float],
                                              TaskProcess]] = None):
        self._open_task = open_task     # None: SSH (else e.g. srun: runner/slurm/srun_tasks.py)
        self._key = key
        self._job_id = job_id
        self._command = list(command)
        self._job_env = job_env
        self._forward_env = dict(forward_env)
        self._ssh = ssh
        self._start_timeout_s = start_timeout_s
        self._sink = sink
        self._wanted_nics = network_interfaces
        self._verbose = verbose
        self._service = DriverService(key, job_id, on_exit=on_exit)
        self._driver = Driver(self._service)
        self._hosts: Dict[str, _HostTask] = {}
        self._all_tasks: List[_HostTask] = []
        self._live: Dict[SlotId, int] = {}           # worker -> index of the task running it
        self._rank_of: Dict[SlotId, int] = {}        # worker -> its rank when last started
        #: tasks (by index) whose host stopped answering -> seconds silent then
        self._unreachable: Dict[int, float] = {}
        self._beats = task_heartbeats.TaskHeartbeats(key, self._beat_targets)
        self._dead_since: Dict[int, float] = {}
        self._seen_exits = 0
        self._iface: Optional[str] = None
        self._rdv: Optional[str] = None

    # ---- hosts ---------------------------------------------------------------------------

    @property
    def rendezvous_addr(self) -> str:
        if self._rdv is None:
            raise HvdliteLaunchError("no interface chosen yet: no host was prepared")
        return self._rdv

    def prepare(self, hosts: Sequence[HostSlots]) -> Dict[str, str]:
        """Start (or reuse) each host's task and wait for it to register.

        Raises:
            HvdliteLaunchError: no interface is routable between the first round's hosts
                (or none of ``--network-interfaces``): the job cannot run.
        """
        todo = [h for h in hosts if h.hostname not in self._hosts
                or self._hosts[h.hostname].task.poll() is not None]
        if not todo:
            return {}
        deadline = time.monotonic() + self._start_timeout_s
        refused: Dict[str, str] = {}
        started: List[_HostTask] = []
        with ThreadPoolExecutor(max_workers=len(todo)) as pool:
            futures = [(h, pool.submit(self._start_task, h, deadline)) for h in todo]
            for h, fut in futures:
                try:
                    started.append(fut.result())
                except (HvdliteError, OSError) as exc:
                    refused[h.hostname] = str(exc)
        if not refused:
            _progress("%d/%d hosts connected", len(started), len(todo))
        unregistered = self._await_registration(started, deadline)
        for ht in started:
            if ht.index in unregistered:
                refused[ht.hostname] = unregistered[ht.index]
        ready = [ht for ht in started if ht.hostname not in refused]
        if not refused:
            _progress("%d/%d tasks registered", len(ready), len(todo))
        self._beats.start()
        if ready and self._iface is None:
            self._choose_interface(ready, started, deadline)
        for ht in ready:
            nics = self._service.registrations[ht.index].nics
            if self._iface not in nics:
                refused[ht.hostname] = (
                    f"it has no interface {self._iface} (the job's interface, chosen between "
                    f"the first round's hosts; it has {', '.join(sorted(nics)) or 'none'})")
        for ht in started:
            if ht.hostname in refused:
                ht.task.close_stdin()
                ht.task.kill()
            else:
                self._hosts[ht.hostname] = ht
        return refused

    def _choose_interface(self, ready: List[_HostTask], started: List[_HostTask],
                          deadline: float) -> None:
        """Probe between the first hosts' tasks and settle the job's interface.

        Raises:
            HvdliteLaunchError: no interface works between them (every task is ended).
        """
        try:
            self._iface, self._rdv = self._driver.choose_interface(
                deadline, self._wanted_nics, verbose=self._verbose,
                indices=[ht.index for ht in ready])
        except (HvdliteError, OSError) as exc:
            for ht in started:
                ht.task.close_stdin()
                ht.task.kill()
            raise HvdliteLaunchError(
                f"choosing the network interface between "
                f"{', '.join(ht.hostname for ht in ready)} failed: {exc}") from None
        log.warning("using interface %s; rendezvous at %s", self._iface, self._rdv)

    def _start_task(self, host: HostSlots, deadline: float) -> _HostTask:
        for old in self._all_tasks:      # the host is back: its old silence explains nothing
            if old.hostname == host.hostname:
                self._unreachable.pop(old.index, None)
        index = self._service.add_host(host.hostname)
        local = is_local(host.hostname)
        payload = {
            "key": self._key.hex(), "job_id": self._job_id, "host_index": index,
            "hostname": host.hostname, "driver": self._driver.addresses(),
            "env": self._forward_env, "cwd": os.getcwd(),
            "timeout_s": max(1.0, deadline - time.monotonic()), "verbose": self._verbose,
            "ssh": self._open_task is None and not local,
        }
        timeout_s = max(1.0, deadline - time.monotonic())
        task = (self._open_task(host, local, payload, timeout_s) if self._open_task
                else start_task(host, local, payload, self._ssh, timeout_s=timeout_s))
        task.pump_output(on_rank_line=self._sink.write,
                         on_other_line=lambda line, h=host.hostname: _task_line(h, line))
        ht = _HostTask(host.hostname, index, task)
        self._all_tasks.append(ht)
        log.info("task started on %s (%s)", host.hostname,
                 "local" if local else f"ssh port {self._ssh.port}")
        return ht

    def _await_registration(self, started: List[_HostTask],
                            deadline: float) -> Dict[int, str]:
        """Wait until each task registered; returns ``{host index: why}`` for those that
        did not."""
        svc = self._service
        failed: Dict[int, str] = {}
        with svc.cond:
            while True:
                waiting = [ht for ht in started
                           if ht.index not in svc.registrations and ht.index not in failed]
                for ht in waiting:
                    code = ht.task.poll()
                    if code is not None:
                        failed[ht.index] = (f"its task exited with code {code} before "
                                            f"registering with the driver")
                waiting = [ht for ht in waiting if ht.index not in failed]
                left = deadline - time.monotonic()
                if not waiting:
                    break
                if left <= 0:
                    for ht in waiting:
                        failed[ht.index] = (
                            f"its task did not register with the driver within "
                            f"--start-timeout {self._start_timeout_s:g}s (a firewall?)")
                    break
                svc.cond.wait(min(left, 0.2))
        return failed

    # ---- workers -------------------------------------------------------------------------

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        env = dict(self._job_env())
        env[cfg.GLOO_IFACE] = self._iface or ""
        by_host: Dict[str, List[SlotInfo]] = {}
        for s in slots:
            by_host.setdefault(s.hostname, []).append(s)
            self._rank_of[slot_id(s)] = s.rank
        failed: Dict[SlotId, str] = {}

        def run(host: str, host_slots: List[SlotInfo]) -> Dict[SlotId, str]:
            ht = self._hosts.get(host)
            if ht is None or ht.task.poll() is not None:
                return {slot_id(s): f"host {host} has no running task" for s in host_slots}
            try:
                reply, _ = self._driver.client(ht.index).request(
                    {"op": "run", "slots": [dataclasses.asdict(s) for s in host_slots],
                     "command": self._command, "env": env},
                    timeout_s=max(5.0, self._start_timeout_s))
            except (HvdliteError, OSError) as exc:
                return {slot_id(s): f"starting workers on host {host} failed: {exc}"
                        for s in host_slots}
            bad = {(host, int(lr)): str(why) for lr, why in reply.get("failed", [])}
            for s in host_slots:
                if slot_id(s) not in bad:
                    self._live[slot_id(s)] = ht.index
            return bad

        with ThreadPoolExecutor(max_workers=max(1, len(by_host))) as pool:
            for result in pool.map(lambda kv: run(*kv), list(by_host.items())):
                failed.update(result)
        _progress("%d workers started on %d hosts", len(slots) - len(failed), len(by_host))
        return failed

    def suspended(self) -> List[SlotId]:
        """Ask every task which of its workers are stopped (bounded, best effort; a host
        that stopped answering is not asked)."""
        out: List[SlotId] = []
        for ht in list(self._hosts.values()):
            if self._silent(ht):
                continue
            try:
                reply, _ = self._driver.client(ht.index, 3.0).request({"op": "stopped"},
                                                                      timeout_s=3.0)
            except (HvdliteError, OSError) as exc:
                log.info("stopped workers on %s: %s", ht.hostname, exc)
                continue
            local = reply.get("local_ranks")
            if isinstance(local, list):
                out += [(ht.hostname, lr) for lr in local if isinstance(lr, int)]
        return out

    def stop(self, ids: Sequence[SlotId]) -> None:
        by_index: Dict[int, List[SlotId]] = {}
        for sid in ids:
            if sid in self._live:
                by_index.setdefault(self._live[sid], []).append(sid)
        for index, sids in by_index.items():
            threading.Thread(target=self._request_stop, args=(index, sids), daemon=True,
                             name="elastic-task-stop").start()

    def _request_stop(self, index: int, sids: List[SlotId]) -> None:
        try:
            self._driver.client(index, TASK_REQUEST_S).request(
                {"op": "stop", "slots": [list(s) for s in sids]}, timeout_s=TASK_REQUEST_S)
        except (HvdliteError, OSError) as exc:
            log.info("stop on %s: %s", self._service.hostnames[index], exc)

    def poll(self) -> List[Tuple[SlotId, int]]:
        with self._service.cond:
            exits = self._service.slot_exits[self._seen_exits:]
            self._seen_exits = len(self._service.slot_exits)
        for sid, _ in exits:
            self._live.pop(sid, None)
        now = time.monotonic()
        for ht in list(self._hosts.values()):
            code = ht.task.poll()
            pending = [sid for sid, index in self._live.items() if index == ht.index]
            if code is None or not pending:
                continue
            first = self._dead_since.setdefault(ht.index, now)
            if now - first < TASK_LOST_GRACE_S:
                continue             # its last reports may still be in flight
            log.warning("the task on host %s ended (code %s; connection lost?) while workers "
                        "%s ran there", ht.hostname, code,
                        ", ".join(f"{h}:{lr}" for h, lr in pending))
            for sid in pending:
                del self._live[sid]
                exits.append((sid, TASK_LOST_CODE))
        exits += self._lost_to_silence()
        return exits

    # ---- liveness ------------------------------------------------------------------------

    def _beat_targets(self) -> task_heartbeats.Targets:
        regs = self._service.registrations
        return {ht.index: (regs[ht.index].addr, regs[ht.index].port, ht.hostname)
                for ht in list(self._hosts.values())
                if ht.index in regs and ht.task.poll() is None
                and ht.index not in self._unreachable}

    def _silent(self, ht: _HostTask, at_least: float = task_heartbeats.SUSPECT_S) -> bool:
        return ht.index in self._unreachable or (
            ht.task.poll() is None and self._beats.silent_for(ht.index) >= at_least)

    def _lost_to_silence(self) -> List[Tuple[SlotId, int]]:
        """The workers of hosts that stopped answering, as lost (once per task).  The task
        is cut off and forgotten: if the host comes back (an elastic job), it gets a new
        task, whose workers take the state from a live peer; the old one, hearing nothing,
        ends its own workers."""
        exits = []
        for ht in list(self._hosts.values()):
            silent = self._beats.silent_for(ht.index)
            pending = [sid for sid, index in self._live.items() if index == ht.index]
            if silent < task_heartbeats.UNREACHABLE_S or not pending \
                    or ht.index in self._unreachable:
                continue
            self._unreachable[ht.index] = silent
            log.warning("host %s stopped answering: its task service has not replied for "
                        "%.0fs (a cut link, or a host that froze or went down); its workers "
                        "%s are lost", ht.hostname, silent,
                        ", ".join(f"{h}:{lr}" for h, lr in pending))
            for sid in pending:
                del self._live[sid]
                exits.append((sid, TASK_LOST_CODE))
            ht.task.kill()
            del self._hosts[ht.hostname]
        return exits

    def describe_failure(self, sid: SlotId, code: int) -> Optional[str]:
        """When a host stopped answering, the summary names it and its ranks first (the
        ranks elsewhere that failed only noticed it was gone); else None."""
        silent = [(self._unreachable.get(ht.index, self._beats.silent_for(ht.index)), ht)
                  for ht in self._all_tasks if self._silent(ht)]
        if not silent:
            return None
        seconds, ht = max(silent, key=lambda item: item[0])
        ranks = sorted(r for s, r in self._rank_of.items() if s[0] == ht.hostname)
        line = (f"hvdlite-run: host {ht.hostname} stopped answering: its task service has "
                f"not replied for {seconds:.0f}s (a cut link, or a host that froze or went "
                f"down); rank{'s' if len(ranks) != 1 else ''} "
                f"{', '.join(map(str, ranks))} on it {'are' if len(ranks) != 1 else 'is'} lost")
        if sid[0] != ht.hostname and sid in self._rank_of:
            line += (f"; rank {self._rank_of[sid]} on host {sid[0]} then failed "
                     f"({describe_exit(code)})")
        return line + "; the other ranks were terminated.\n"

    def stop_all(self) -> None:
        """Tell every task to end its workers, close their lifelines, wait (bounded).  A
        host that stopped answering is cut off at once: nothing it would say can arrive
        (its task ends its workers itself when the launcher falls silent)."""
        self._beats.stop()
        tasks = [ht for ht in self._all_tasks if ht.task.poll() is None]
        for ht in [ht for ht in tasks if self._silent(ht)]:
            log.warning("cutting off the task on %s, which stopped answering", ht.hostname)
            ht.task.kill()
            tasks.remove(ht)
        indices = [ht.index for ht in tasks if ht.index in self._service.registrations]

        def term(index):
            try:
                self._driver.client(index, 3.0).request({"op": "terminate"}, timeout_s=3.0)
            except (HvdliteError, OSError) as exc:
                log.info("terminate on %s: %s", self._service.hostnames[index], exc)

        if indices:
            with ThreadPoolExecutor(max_workers=len(indices)) as pool:
                list(pool.map(term, indices))
        for ht in tasks:
            ht.task.close_stdin()
        deadline = time.monotonic() + TASK_SHUTDOWN_GRACE_S
        for ht in tasks:
            if ht.task.wait(max(0.0, deadline - time.monotonic())) is None:
                log.warning("the task on %s did not exit in %.0fs; cutting it off",
                            ht.hostname, TASK_SHUTDOWN_GRACE_S)
                ht.task.kill()
        for ht in self._all_tasks:
            ht.task.join_output(2.0)

    def close(self) -> None:
        self._beats.stop()
        self._driver.shutdown()


def _progress(msg: str, *args) -> None:
    sys.stderr.write("hvdlite-run: " + (msg % args) + "\n")
    sys.stderr.flush()


def _task_line(hostname: str, line: bytes) -> None:
    sys.stderr.buffer.write(f"[{hostname}]<task>:".encode() + line.rstrip(b"\n") + b"\n")
    sys.stderr.flush()
