"""The task service: one per host of a multi-host job, started by the launcher.

``python -m hvdlite.runner.tasks.task_service`` reads one JSON line from stdin (job key,
driver addresses, this host's index, the forwarded environment), finds a
driver address it can reach, registers this host's interfaces, and serves:

* ``ping`` -> ``{role: "task", job_id, host_index}`` (the identity a probe checks)
* ``probe {targets: [[iface, addr, port]], expect_host_index, timeout_s, attempts?}`` ->
  ``{reachable: [iface]}``: the interfaces on which the expected task answered (a
  silent one is tried ``attempts`` times, default 1)
* ``run {slots, command, env}``: start a worker on each given slot that has no live
  worker yet; answers ``{failed: [[local_rank, why]]}`` for those that could not start
* ``stop {slots: [[hostname, local_rank]]}``: end those workers' process trees; their
  exits are reported like any other
* ``terminate``: end the workers' process trees and exit
* ``stopped`` -> ``{local_ranks: [...]}``: the local slots of this host's workers whose
  process is stopped (SIGSTOP or a debugger), so that the launcher names a silent rank
  rather than the one that noticed
* ``py_spy {slots: [[hostname, local_rank]], timeout_s}`` -> ``{stacks: [{slot, pid,
  threads, note}]}``: those workers' Python stacks, taken from outside their processes by
  py-spy (``runner/processes/py_spy.py``) within ``timeout_s``; only this job's own
  workers are read, and the reply is cut to :data:`MAX_PY_SPY_REPLY_BYTES`

Worker output goes to our stdout as ``[rank]<stream>:line`` (the launcher
routes it; a worker keeps the rank it started with); worker exits are reported to
the driver (``worker_exit`` with the local slot that names the worker).  The task
waits for more ``run`` calls until ``terminate``; when stdin closes, the launcher is
gone or done: the task ends its workers and exits.  A cut link gives no end of file:
the launcher pings every task once a second, and a task that hears nothing for
:data:`LAUNCHER_SILENT_S`, or cannot report a worker's exit, ends its workers, exits and
ends the SSH session that started it.
"""

import json
import logging
import os
import select
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import psutil

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteError, HvdliteLaunchError
from hvdlite.common.net.service import Client, Service, ServiceError, is_int
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.processes import py_spy
from hvdlite.runner.tasks.nics import discover_nics
from hvdlite.runner.processes.workers import WorkerGroup, terminate_groups
from hvdlite.runner.processes.rank_output import OutputSink

log = logging.getLogger("hvdlite.runner.tasks.task_service")

STDIN_FD = 0

_SLOT_FIELDS = {f: int for f in ("rank", "local_rank", "cross_rank", "size", "local_size",
                                 "cross_size", "host_index", "host_count")}


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ServiceError(f"malformed request: {what}")


def parse_slots(raw) -> List[SlotInfo]:
    _check(isinstance(raw, list) and raw, "slots must be a non-empty list")
    slots = []
    for s in raw:
        _check(isinstance(s, dict) and isinstance(s.get("hostname"), str)
               and all(is_int(s.get(f)) for f in _SLOT_FIELDS), "slot fields")
        slots.append(SlotInfo(hostname=s["hostname"], **{f: s[f] for f in _SLOT_FIELDS}))
    return slots


def probe_targets(key: bytes, job_id: str, targets, expect: int, timeout_s: float,
                  attempts: int = 1) -> List[str]:
    """The interfaces on which the task with host index ``expect`` answers a ping.

    A target that gives no answer (a timeout, a reset) is tried up to ``attempts`` times:
    on a lossy link two lost SYNs outlast a short timeout, and one such loss must not
    rule out the only interface between two hosts.  A wrong identity is an answer, not
    retried."""
    reachable = []
    for iface, addr, port in targets:
        for attempt in range(1, attempts + 1):
            client = Client((addr, port), key, timeout_s, name=f"task service at {addr}")
            try:
                reply, _ = client.request({"op": "ping"}, timeout_s=timeout_s)
                if (reply.get("role") == "task" and reply.get("job_id") == job_id
                        and reply.get("host_index") == expect):
                    reachable.append(iface)
                break
            except (HvdliteError, OSError) as exc:
                log.info("probe %d/%d of %s %s:%s failed: %s", attempt, attempts, iface,
                         addr, port, exc)
            finally:
                client.close()
    return reachable


#: a task that has heard nothing from the launcher for this long (it pings every task once
#: a second, ``hvdlite.runner.tasks.heartbeats``) takes it for gone -- a cut link
#: gives no end of file on the lifeline -- and ends its workers and itself
LAUNCHER_SILENT_S = 15.0
#: bounds on one ``py_spy`` request: its time, its workers and its reply
MAX_PY_SPY_S = 60.0
MAX_PY_SPY_SLOTS = 1024
MAX_PY_SPY_REPLY_BYTES = 4 * 1024 * 1024


class TaskService(Service):
    """Serves the requests above; ``on_run``/``on_terminate`` do the work."""

    def __init__(self, key: bytes, job_id: str, host_index: int,
                 on_run: Callable[[List[SlotInfo], List[str], Dict[str, str]], Optional[dict]],
                 on_terminate: Callable[[], None], bind_addr: str = "0.0.0.0",
                 on_stop: Optional[Callable[[List[Tuple[str, int]]], None]] = None,
                 on_stopped: Optional[Callable[[], List[int]]] = None,
                 on_py_spy: Optional[Callable[[List[Tuple[str, int]], float],
                                              List[dict]]] = None, **limits):
        """``on_py_spy(slots, timeout_s)``: the ``py_spy`` reply's entries for those of
        ``slots`` that have a live worker here."""
        self.job_id = job_id
        self.host_index = host_index
        self._on_run = on_run
        self._on_terminate = on_terminate
        self._on_stop = on_stop
        self._on_stopped = on_stopped
        self._on_py_spy = on_py_spy
        self._lock = threading.Lock()
        self._last_request = time.monotonic()
        super().__init__("task service", key, bind_addr, **limits)

    def silent_for(self) -> float:
        """Seconds since the last authenticated request (the launcher's pings included)."""
        return time.monotonic() - self._last_request

    def handle(self, header, blob, client):
        self._last_request = time.monotonic()
        op = header.get("op")
        if op == "ping":
            return {"role": "task", "job_id": self.job_id, "host_index": self.host_index}, b""
        if op == "probe":
            targets = header.get("targets")
            _check(isinstance(targets, list) and len(targets) <= 64 and all(
                isinstance(t, list) and len(t) == 3 and isinstance(t[0], str)
                and isinstance(t[1], str) and is_int(t[2]) and 0 < t[2] < 65536
                for t in targets), "targets")
            expect, timeout_s = header.get("expect_host_index"), header.get("timeout_s")
            _check(is_int(expect), "expect_host_index")
            _check(isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 60, "timeout_s")
            attempts = header.get("attempts", 1)
            _check(is_int(attempts) and 1 <= attempts <= 5, "attempts")
            return {"reachable": probe_targets(self._key, self.job_id, targets, expect,
                                               float(timeout_s), attempts)}, b""
        if op == "run":
            slots = parse_slots(header.get("slots"))
            command, env = header.get("command"), header.get("env")
            _check(isinstance(command, list) and command
                   and all(isinstance(c, str) for c in command), "command")
            _check(isinstance(env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()), "env")
            with self._lock:
                reply = self._on_run(slots, command, env)
            return reply or {}, b""
        if op == "stop" and self._on_stop is not None:
            raw = header.get("slots")
            _check(isinstance(raw, list) and all(
                isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and is_int(x[1])
                for x in raw), "slots must be a list of [hostname, local_rank]")
            self._on_stop([(x[0], x[1]) for x in raw])
            return {}, b""
        if op == "terminate":
            self._on_terminate()
            return {}, b""
        if op == "stopped":
            return {"local_ranks": self._on_stopped() if self._on_stopped else []}, b""
        if op == "py_spy":
            raw, timeout_s = header.get("slots"), header.get("timeout_s")
            _check(isinstance(raw, list) and len(raw) <= MAX_PY_SPY_SLOTS and all(
                isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and is_int(x[1])
                for x in raw), "slots must be a list of [hostname, local_rank]")
            _check(isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                   and 0 < timeout_s <= MAX_PY_SPY_S,
                   f"timeout_s must be in (0, {MAX_PY_SPY_S:g}]")
            stacks = self._on_py_spy([(x[0], x[1]) for x in raw], float(timeout_s)) \
                if self._on_py_spy else []
            return {"stacks": fit_reply(stacks, MAX_PY_SPY_REPLY_BYTES)}, b""
        raise ServiceError(f"unknown task operation {op!r}")


def fit_reply(stacks: List[dict], max_bytes: int) -> List[dict]:
    """``py_spy``'s entries, the threads of the last ones dropped (and said so) until the
    reply's JSON fits in ``max_bytes``."""
    out = list(stacks)
    size = len(json.dumps(out))
    for i in range(len(out) - 1, -1, -1):
        if size <= max_bytes:
            break
        if out[i].get("threads") is not None:
            out[i] = dict(out[i], threads=None,
                          note=f"stacks dropped: the reply would exceed {max_bytes} bytes")
            size = len(json.dumps(out))
    return out


def default_gloo_socket_ifname(job_env: Dict[str, str], base: Dict[str, str]) -> None:
    """Name the job's interface in ``GLOO_SOCKET_IFNAME`` for a torch.distributed program.

    torch's Gloo groups bind to the address the host's name resolves to, which on many
    machines is a loopback one (Debian lists the host name as 127.0.1.1): ranks on two hosts
    would then never connect.  Where the launcher set torchrun's variables, a rank gets the
    interface the launcher found routable between the hosts (``HVDLITE_GLOO_IFACE``), unless
    its environment already names one (``-x``, or this host's own environment)."""
    iface = job_env.get(cfg.GLOO_IFACE)
    name = cfg.TORCH_GLOO_SOCKET_IFNAME
    if iface and cfg.TORCH_MASTER_ADDR in job_env and name not in job_env and name not in base:
        job_env[name] = iface


class _Task:
    def __init__(self, payload: dict):
        self.key = bytes.fromhex(payload["key"])
        self.job_id = payload["job_id"]
        self.host_index = int(payload["host_index"])
        self.hostname = payload["hostname"]
        self.forward_env = dict(payload.get("env") or {})
        self.timeout_s = float(payload.get("timeout_s", 30))
        self.driver_addrs = payload["driver"]
        self.stop = threading.Event()
        #: set when run() returns: the stdin watcher then ends too
        self.exiting = threading.Event()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        #: one group per worker, so that one worker can be stopped alone
        self.groups: List[WorkerGroup] = []
        self.live: Dict[Tuple[str, int], WorkerGroup] = {}
        self.sink = OutputSink(out=sys.stdout.buffer, err=sys.stdout.buffer)
        self.driver: Optional[Client] = None
        #: started by the launcher over SSH (not locally, by srun or an agent command)
        self.via_ssh = bool(payload.get("ssh"))
        #: the launcher stopped answering mid-job (a cut link): see _end_own_ssh_session
        self.launcher_lost = False
        cwd = payload.get("cwd")
        self.cwd = cwd if cwd and os.path.isdir(cwd) else None

    def on_run(self, slots, command, env) -> dict:
        """Start a worker for each slot without a live one; answers ``{failed: [[local_rank,
        why]]}`` for the workers that could not start."""
        base = dict(os.environ)
        base.update(self.forward_env)
        job_env = dict(env)
        job_env[cfg.SECRET_KEY] = self.key.hex()   # the key came over SSH, not the wire
        default_gloo_socket_ifname(job_env, base)
        failed = []
        try:
            for slot in slots:
                sid = (slot.hostname, slot.local_rank)
                with self.lock:
                    if sid in self.live or self.stop.is_set():
                        continue
                group = WorkerGroup([slot], command, job_env, self.sink, base_env=base,
                                    cwd=self.cwd)
                try:
                    group.start()
                except HvdliteLaunchError as exc:
                    failed.append([slot.local_rank, str(exc)])
                    continue
                with self.lock:
                    self.groups.append(group)
                    self.live[sid] = group
        finally:
            self.wake.set()
        return {"failed": failed}

    def on_stop(self, ids: List[Tuple[str, int]]) -> None:
        with self.lock:
            groups = [self.live[i] for i in ids if i in self.live]
        for g in groups:
            threading.Thread(target=g.terminate, name="task-stop", daemon=True).start()

    def on_terminate(self):
        self.stop.set()
        self.wake.set()

    def on_stopped(self) -> List[int]:
        """The local slots of this host's workers whose process is stopped."""
        with self.lock:
            groups = list(self.live.values())
        return [slot.local_rank for g in groups for slot in g.stopped_slots()]

    def on_py_spy(self, ids: List[Tuple[str, int]], timeout_s: float) -> List[dict]:
        """py-spy of each of ``ids`` that is a live worker of this task (never another
        process): ``[{slot, pid, threads, note}]``."""
        with self.lock:
            pids = {sid: self.live[sid].procs[0].pid for sid in ids
                    if sid in self.live and self.live[sid].procs
                    and self.live[sid].procs[0].returncode is None}
        taken = py_spy.dumps(pids, timeout_s)
        return [{"slot": list(sid), "pid": got.pid, "threads": got.threads, "note": got.note}
                for sid, got in taken.items()]

    def _lifeline(self):
        """Watch stdin (the launcher's end of the pipe or SSH channel) until it closes.

        Reads the raw descriptor with ``select`` + ``os.read``, never ``sys.stdin``: a
        daemon thread blocked inside a buffered reader at interpreter exit makes Python
        abort ("Fatal Python error: _enter_buffered_busy").  It also stops when the task
        does, so nothing is left blocked at exit.
        """
        while not self.exiting.is_set():
            try:
                ready, _, _ = select.select([STDIN_FD], [], [], 0.2)
                if ready and not os.read(STDIN_FD, 65536):
                    break
            except (OSError, ValueError):
                break
        else:
            return
        log.info("stdin closed: the launcher is done or gone")
        self.on_terminate()

    def _find_driver(self) -> List[str]:
        """Ping every driver address; connect through the first that answers.  While none
        does, try them all again until the start timeout (a flood of strangers may keep
        the driver's door busy for a while; an address that never answers costs its 3 s)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._try_driver_addresses()
            except HvdliteLaunchError:
                if time.monotonic() + 1.0 >= deadline or self.stop.is_set():
                    raise
                self.stop.wait(1.0)

    def _try_driver_addresses(self) -> List[str]:
        reachable, chosen = [], None
        for iface, addr, port in self.driver_addrs:
            client = Client((addr, int(port)), self.key, min(3.0, self.timeout_s),
                            name=f"driver at {addr}:{port}")
            try:
                reply, _ = client.request({"op": "ping"})
                if reply.get("role") == "driver" and reply.get("job_id") == self.job_id:
                    reachable.append(iface)
                    if chosen is None:
                        chosen = client
                        continue
            except (HvdliteError, OSError) as exc:
                log.info("driver address %s %s:%s unreachable: %s", iface, addr, port, exc)
            client.close()
        if chosen is None:
            raise HvdliteLaunchError(
                f"host {self.hostname}: cannot reach the driver at any of "
                f"{[a[1:] for a in self.driver_addrs]}")
        self.driver = chosen
        return reachable

    def run(self) -> int:
        service = TaskService(self.key, self.job_id, self.host_index, self.on_run,
                              self.on_terminate, on_stop=self.on_stop,
                              on_stopped=self.on_stopped, on_py_spy=self.on_py_spy)
        watcher = threading.Thread(target=self._lifeline, name="task-lifeline", daemon=True)
        watcher.start()
        try:
            reachable = self._find_driver()
            self.driver.request({"op": "register", "host_index": self.host_index,
                                 "hostname": self.hostname, "nics": discover_nics(),
                                 "port": service.address[1], "driver_reachable": reachable})
            while not self.stop.is_set():
                self._report_exits()
                if self.sink.broken.is_set():
                    log.warning("host %s: output pipe to the launcher broke; stopping",
                                self.hostname)
                    break
                if service.silent_for() > LAUNCHER_SILENT_S:
                    sys.stderr.write(f"hvdlite task on {self.hostname}: nothing from the "
                                     f"launcher for {LAUNCHER_SILENT_S:.0f}s (a cut link?); "
                                     f"ending this host's workers\n")
                    self.launcher_lost = True
                    break
                self.wake.wait(0.05)
                self.wake.clear()
            return 0
        except (HvdliteError, OSError) as exc:
            sys.stderr.write(f"hvdlite task on {self.hostname}: {exc}\n")
            return 2
        finally:
            self._end_workers()
            service.shutdown()
            if self.driver is not None:
                self.driver.close()
            self.exiting.set()
            watcher.join(timeout=2.0)
            if self.launcher_lost:
                _end_own_ssh_session(self.via_ssh)

    def _report_exits(self) -> None:
        with self.lock:
            live = list(self.live.items())
        for sid, group in live:
            for slot, code in group.poll():
                with self.lock:
                    if self.live.get(sid) is group:
                        del self.live[sid]
                group.join_output(1.0)      # its last lines (a traceback) before its exit
                try:
                    self.driver.request({"op": "worker_exit", "host_index": self.host_index,
                                         "rank": slot.rank, "local_rank": slot.local_rank,
                                         "code": code})
                except (HvdliteError, OSError):
                    self.launcher_lost = True
                    raise

    def _end_workers(self) -> None:
        with self.lock:
            self.stop.set()           # no run call starts anything from now on
            groups = list(self.groups)
        terminate_groups(groups)


#: the names of an OpenSSH server's per-connection processes (9.8 split them out)
_SSHD_NAMES = ("sshd", "sshd-session")


def _end_own_ssh_session(via_ssh: bool) -> None:
    """End the sshd processes serving this task's own connection (never the listener).

    When the launcher's link is cut, the session that started this task cannot tell its
    client that the task ended: without keep-alives configured, sshd would wait for that
    dead connection for many minutes, a process of the job left on the host.  Only a task
    started over SSH does this, so a local task never touches a user's login session."""
    if not via_ssh:
        return
    sys.stderr.flush()
    try:
        proc = psutil.Process().parent()
        while proc is not None and proc.name() in _SSHD_NAMES:
            title = " ".join(proc.cmdline())
            if "listener" in title or not title.startswith(_SSHD_NAMES):
                return
            parent = proc.parent()
            proc.terminate()
            proc = parent
    except psutil.Error as exc:
        log.info("could not end this task's SSH session: %s", exc)


def _read_payload_line(limit: int = 1 << 20) -> bytes:
    """The first line of stdin, read from the raw descriptor (see ``_Task._lifeline``).

    The launcher writes only this line before the stream's end, so nothing is read past
    it."""
    data = b""
    while b"\n" not in data and len(data) < limit:
        chunk = os.read(STDIN_FD, 65536)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]


def main() -> int:
    line = _read_payload_line()
    if not line:
        return 2
    try:
        payload = json.loads(line)
    except ValueError:
        sys.stderr.write("hvdlite task: the start-up payload on stdin is not JSON\n")
        return 2
    logging.basicConfig(level=logging.INFO if payload.get("verbose") else logging.WARNING,
                        format=f"task {payload.get('hostname')}: %(message)s")
    return _Task(payload).run()


if __name__ == "__main__":
    sys.exit(main())
