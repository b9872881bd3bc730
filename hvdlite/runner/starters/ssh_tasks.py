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
ranks that merely noticed it was gone.  Unless its ranks still report to the launcher's
store themselves (``ranks_heard``): then only the task service is paused or slow, the
launcher says so and goes on, and the workers count as lost only once they fall silent
too, or after ``SERVICE_ONLY_S``.  Its task is cut off and forgotten: a host that
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
from hvdlite.common.net.service import Client
from hvdlite.runner.hosts import HostSlots, SlotInfo, is_local
from hvdlite.runner.processes.py_spy import OutsideStack, valid_threads
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
#: bound on one probe between two hosts' tasks (a partial partition, ``cut_links``)
PROBE_S = 2.0


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
                                              TaskProcess]] = None,
                 ranks_heard: Callable[[str, float], bool] = lambda host, within_s: False):
        """``ranks_heard(host, within_s)``: did a rank on ``host`` report to the launcher's
        store within the last ``within_s`` seconds (``store.liveness``)?"""
        self._ranks_heard = ranks_heard
        #: tasks (by index) said to be silent while their ranks still report
        self._service_only: Dict[int, float] = {}
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
        names = {h.hostname for h in hosts}
        others = [ht for ht in self._hosts.values() if ht.hostname not in names
                  and ht.task.poll() is None and not self._silent(ht)]
        todo = [h for h in hosts if h.hostname not in self._hosts
                or self._hosts[h.hostname].task.poll() is not None]
        refused = self._start_tasks(todo) if todo else {}
        joining = [self._hosts[n] for n in names if n in self._hosts and n not in refused]
        if others and joining and self._iface is not None:
            # a host that comes back (or joins) must reach the hosts already training
            for a, b in self._cut_between(others + joining, joining):
                new, old = (a, b) if a in names else (b, a)
                refused.setdefault(new, f"it cannot reach host {old} (a probe between their "
                                        f"task services failed: a partial network partition)")
        return refused

    def _start_tasks(self, todo: Sequence[HostSlots]) -> Dict[str, str]:
        """Start the tasks of ``todo``'s hosts and wait for them to register; ``{host:
        why}`` for those that could not."""
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

    def outside_stacks(self, ids: Sequence[SlotId],
                       timeout_s: float) -> Dict[SlotId, OutsideStack]:
        """Each host's task takes its workers' stacks with py-spy (op ``py_spy``), all hosts
        at once, on a connection of this call's own (a slow py-spy never holds up the
        driver's requests).  A host that stopped answering is not asked."""
        live = dict(self._live)
        by_index: Dict[int, List[SlotId]] = {}
        for sid in ids:
            if sid in live:
                by_index.setdefault(live[sid], []).append(sid)
        tasks = {ht.index: ht for ht in list(self._hosts.values())}
        regs = self._service.registrations
        out: Dict[SlotId, OutsideStack] = {}

        def ask(index: int, sids: List[SlotId]) -> Dict[SlotId, OutsideStack]:
            ht, reg = tasks.get(index), regs.get(index)
            if ht is None or reg is None or self._silent(ht):
                return {sid: OutsideStack(0, None, f"host {sid[0]}'s task service does not "
                                                   f"answer") for sid in sids}
            client = Client((reg.addr, reg.port), self._key, min(timeout_s, TASK_REQUEST_S),
                            name=f"task service on {ht.hostname}")
            try:
                reply, _ = client.request({"op": "py_spy", "slots": [list(s) for s in sids],
                                           "timeout_s": timeout_s},
                                          timeout_s=timeout_s + TASK_REQUEST_S)
            except (HvdliteError, OSError) as exc:
                return {sid: OutsideStack(0, None, f"asking host {ht.hostname}'s task for "
                                                   f"py-spy failed: {exc}") for sid in sids}
            finally:
                client.close()
            got: Dict[SlotId, OutsideStack] = {}
            entries = reply.get("stacks")
            for entry in entries if isinstance(entries, list) else []:
                slot = entry.get("slot") if isinstance(entry, dict) else None
                if not (isinstance(slot, list) and len(slot) == 2
                        and (slot[0], slot[1]) in sids):
                    continue
                pid = entry.get("pid")
                got[(slot[0], slot[1])] = OutsideStack(
                    pid if isinstance(pid, int) else 0, valid_threads(entry.get("threads")),
                    str(entry.get("note") or "")[:1000])
            return got

        if by_index:
            with ThreadPoolExecutor(max_workers=len(by_index),
                                    thread_name_prefix="hvdlite-py-spy") as pool:
                for result in pool.map(lambda kv: ask(*kv), list(by_index.items())):
                    out.update(result)
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
            if silent < task_heartbeats.SUSPECT_S and \
                    self._service_only.pop(ht.index, None) is not None:
                log.warning("the task service on host %s answers again", ht.hostname)
            if silent < task_heartbeats.UNREACHABLE_S or not pending \
                    or ht.index in self._unreachable or self._only_service_silent(ht, silent):
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

    def cut_links(self, hosts: Sequence[str]) -> List[Tuple[str, str]]:
        """Each of these hosts' tasks pings the others' on the job's interface (a host whose
        task stopped answering the launcher is left to the heartbeats)."""
        tasks = [self._hosts[h] for h in dict.fromkeys(hosts) if h in self._hosts]
        tasks = [ht for ht in tasks if ht.task.poll() is None and not self._silent(ht)]
        if len(tasks) < 2 or self._iface is None:
            return []
        return self._cut_between(tasks, None)

    def _cut_between(self, tasks: List[_HostTask],
                     involving: Optional[List[_HostTask]]) -> List[Tuple[str, str]]:
        name = {ht.index: ht.hostname for ht in tasks}
        order = {ht.index: pos for pos, ht in enumerate(tasks)}
        pairs = self._driver.cut_pairs(
            [ht.index for ht in tasks], self._iface, timeout_s=PROBE_S,
            involving=None if involving is None else {ht.index for ht in involving})
        return [(name[i], name[j]) if order[i] < order[j] else (name[j], name[i])
                for i, j in pairs]

    def _only_service_silent(self, ht: _HostTask, silent: float) -> bool:
        """Is only the task service silent (its ranks still report to the store), and for
        less than ``SERVICE_ONLY_S``?  Said once per silence."""
        if silent >= task_heartbeats.SERVICE_ONLY_S or \
                not self._ranks_heard(ht.hostname, task_heartbeats.SUSPECT_S):
            return False
        if ht.index not in self._service_only:
            self._service_only[ht.index] = silent
            log.warning("the task service on host %s has not replied for %.0fs, but the "
                        "host's ranks still report to the launcher: going on (a paused or "
                        "overloaded task service; its workers count as lost if they fall "
                        "silent too, or if it stays silent for %.0fs)", ht.hostname, silent,
                        task_heartbeats.SERVICE_ONLY_S)
        return True

    def describe_failure(self, sid: SlotId, code: int) -> Optional[str]:
        """When a host stopped answering, the summary names it and its ranks first (the
        ranks elsewhere that failed only noticed it was gone); else None."""
        silent = [(self._unreachable.get(ht.index, self._beats.silent_for(ht.index)), ht)
                  for ht in self._all_tasks if self._silent(ht)
                  and (ht.index in self._unreachable
                       or not self._ranks_heard(ht.hostname, task_heartbeats.SUSPECT_S))]
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
