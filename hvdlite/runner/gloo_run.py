"""Static Gloo launch: env per rank, start, stream output, propagate failures.

Two entry points share the pieces below:

* :func:`launch_local` -- every host is this machine: the launcher serves the
  rendezvous store on 127.0.0.1 and starts the ranks itself.
* :func:`launch_multi` -- some host is remote: the launcher runs the driver
  service, starts a task on every host (over SSH for remote ones), picks the
  interface routable between all hosts, serves the store on it, and has each
  task start its host's ranks.  Worker output comes back through the task's
  stdout; worker exits through the driver service.

Either way, when any rank fails every other rank's process tree is ended on
every host and the launcher names the rank, its host and its exit code or signal.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import psutil

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteError
from hvdlite.runner.hosts import HostSlots, SlotInfo, is_local
# the output and exit helpers are shared with MPI mode's per-rank wrapper
from hvdlite.runner.rank_output import (OutputSink, describe_exit, exit_status,  # noqa: F401
                                        pump_lines)
from hvdlite.runner.rendezvous import KVStoreService
from hvdlite.runner.secure import new_key
from hvdlite.runner.service import ServiceError

log = logging.getLogger(__name__)

TERMINATE_GRACE_S = 5.0
#: how long tasks get to end their workers after a failure before we cut them off
TASK_SHUTDOWN_GRACE_S = 10.0


def slot_env(slot: SlotInfo, base_env: Dict[str, str], job_env: Dict[str, str]) -> Dict[str, str]:
    """The one place that builds a rank's environment.

    Unless the user set ``OMP_NUM_THREADS``, each rank gets this host's cores divided by
    its ranks on the host, as torchrun does: N ranks each running as many math threads as
    there are cores oversubscribe the machine and slow every rank down.
    """
    env = dict(base_env)
    env.update(job_env)
    env.update(cfg.rank_env(slot.rank, slot.size, slot.local_rank, slot.local_size,
                            slot.cross_rank, slot.cross_size, slot.hostname))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // slot.local_size)))
    return env


def kill_tree(proc: psutil.Process, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL what is left (bounded)."""
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        log.info("pid %d did not exit after SIGTERM; sending SIGKILL", p.pid)
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


class WorkerGroup:
    """The worker processes of one job on this host (used by the launcher and by tasks)."""

    def __init__(self, slots: List[SlotInfo], command: Sequence[str], job_env: Dict[str, str],
                 sink: OutputSink, base_env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None):
        self.slots = list(slots)
        self.command = list(command)
        self.job_env = dict(job_env)
        self.sink = sink
        self.base_env = dict(os.environ) if base_env is None else dict(base_env)
        self.cwd = cwd
        self.procs: List[subprocess.Popen] = []
        self._pumps: List[threading.Thread] = []
        self._reported = set()
        self._lock = threading.Lock()
        self._terminated = False

    def start(self) -> None:
        """Start one process per slot.

        Raises:
            HvdliteConfigError: the command cannot be started (names the rank).
        """
        for slot in self.slots:
            env = slot_env(slot, self.base_env, self.job_env)
            with self._lock:
                if self._terminated:
                    return
                try:
                    proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            start_new_session=True, cwd=self.cwd)
                except OSError as exc:
                    raise HvdliteConfigError(
                        f"rank {slot.rank} on host {slot.hostname}: cannot start "
                        f"{self.command[0]!r}: {exc.strerror}") from None
                self.procs.append(proc)
            for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                self._pumps.append(pump_lines(
                    stream, lambda line, r=slot.rank, n=name: self.sink.write(r, n, line),
                    name=f"output-rank{slot.rank}-{name}"))
            log.info("started rank %d on %s as pid %d", slot.rank, slot.hostname, proc.pid)

    def poll(self) -> List[Tuple[SlotInfo, int]]:
        """Ranks that exited since the last call, with their codes."""
        done = []
        for slot, proc in zip(self.slots, list(self.procs)):
            if slot.rank in self._reported:
                continue
            code = proc.poll()
            if code is not None:
                self._reported.add(slot.rank)
                done.append((slot, code))
        return done

    def all_exited(self) -> bool:
        return len(self._reported) == len(self.slots) or (
            self._terminated and all(p.poll() is not None for p in self.procs))

    def join_output(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        for pump in self._pumps:
            pump.join(timeout=max(0.0, deadline - time.monotonic()))

    def terminate(self) -> None:
        """End every worker's whole process tree (idempotent, bounded)."""
        with self._lock:
            self._terminated = True
            procs = list(self.procs)
        live = []
        for proc in procs:
            if proc.poll() is None:
                try:
                    live.append(psutil.Process(proc.pid))
                except psutil.NoSuchProcess:
                    pass
        if live:
            with ThreadPoolExecutor(max_workers=len(live)) as pool:
                list(pool.map(kill_tree, live))
        for proc in procs:
            try:
                proc.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("pid %d survived SIGKILL", proc.pid)


def failure_message(rank: int, host: str, code: int) -> str:
    return (f"hvdlite-run: rank {rank} on host {host} {describe_exit(code)}; "
            f"the other ranks were terminated.\n")


class _Signals:
    """Turns SIGINT/SIGTERM into a stop request while installed."""

    def __init__(self, on_stop: Callable[[], None]):
        self.stopped = threading.Event()
        self._on_stop = on_stop
        self._old = {}

    def __enter__(self):
        def handler(signum, frame):
            if not self.stopped.is_set():
                sys.stderr.write(f"hvdlite-run: received {signal.Signals(signum).name}; "
                                 f"terminating all ranks.\n")
                sys.stderr.flush()
            self.stopped.set()
            self._on_stop()
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def launch_local(slots: List[SlotInfo], command: Sequence[str], tunable_env: Dict[str, str],
                 output_dir: Optional[str] = None, verbose: bool = False,
                 timestamp: bool = False, extra_env: Optional[Dict[str, str]] = None) -> int:
    """Run ``command`` once per slot on this host through Gloo; returns the exit code."""
    key = new_key()
    store = KVStoreService(key, bind_addr="127.0.0.1")
    job_env = dict(tunable_env)
    job_env.update(extra_env or {})
    job_env.update({
        cfg.RENDEZVOUS_ADDR: store.address[0],
        cfg.RENDEZVOUS_PORT: str(store.address[1]),
        cfg.SECRET_KEY: key.hex(),
        cfg.JOB_ID: uuid.uuid4().hex[:12],
        cfg.CPU_OPERATIONS: tunable_env.get(cfg.CPU_OPERATIONS) or "gloo",
    })
    sink = OutputSink(output_dir=output_dir, timestamp=timestamp)
    group = WorkerGroup(slots, command, job_env, sink)
    wake = threading.Event()
    failure = None
    try:
        with _Signals(wake.set) as sig:
            group.start()
            if verbose:
                log.warning("started %d ranks on this host", len(slots))
            while not sig.stopped.is_set():
                for slot, code in group.poll():
                    if code != 0 and failure is None:
                        failure = (slot, code)
                if failure is not None or group.all_exited():
                    break
                wake.wait(0.05)
            stopped = sig.stopped.is_set()
    finally:
        group.terminate()
        group.join_output()
        sink.close()
        store.shutdown()
    if failure is not None:
        slot, code = failure
        sys.stderr.write(failure_message(slot.rank, slot.hostname, code))
        sys.stderr.flush()
        return exit_status(code)
    if stopped:
        return 130
    return 0


# ----------------------------------------------------------------------------------------
# multi-host


def launch_multi(hosts: List[HostSlots], slots: List[SlotInfo], command: Sequence[str],
                 job_env_extra: Dict[str, str], forward_env: Dict[str, str], ssh,
                 start_timeout_s: float, network_interfaces: Optional[List[str]] = None,
                 output_dir: Optional[str] = None, verbose: bool = False,
                 timestamp: bool = False) -> int:
    """Run a job whose hosts include at least one remote one; returns the exit code.

    ``ssh`` is an :class:`hvdlite.runner.ssh.SSHOptions`; ``forward_env`` is the
    allow-listed environment that every host's workers get.
    """
    from hvdlite.runner.driver import Driver
    from hvdlite.runner.ssh import start_task

    def progress(msg, *args):
        sys.stderr.write("hvdlite-run: " + (msg % args) + "\n")
        sys.stderr.flush()

    key = new_key()
    job_id = uuid.uuid4().hex[:12]
    used_hosts = [h for h in hosts if any(s.hostname == h.hostname for s in slots)]
    slots_by_host = [[s for s in slots if s.hostname == h.hostname] for h in used_hosts]
    deadline = time.monotonic() + start_timeout_s
    sink = OutputSink(output_dir=output_dir, timestamp=timestamp)
    driver = Driver(key, job_id, [h.hostname for h in used_hosts], slots_by_host)
    tasks = [None] * len(used_hosts)
    store = None
    failure: Optional[str] = None
    exit_code = 0
    sig = _Signals(driver.wake)
    try:
        with sig:
            # 1. a task on every host
            def start_one(i):
                host = used_hosts[i]
                payload = {
                    "key": key.hex(), "job_id": job_id, "host_index": i,
                    "hostname": host.hostname, "driver": driver.addresses(),
                    "env": forward_env, "cwd": os.getcwd(),
                    "timeout_s": max(1.0, deadline - time.monotonic()),
                    "verbose": verbose,
                }
                local = is_local(host.hostname)
                task = start_task(host, local, payload, ssh,
                                  timeout_s=max(1.0, deadline - time.monotonic()))
                task.pump_output(
                    on_rank_line=sink.write,
                    on_other_line=lambda line, h=host.hostname: _task_line(h, line))
                if verbose:
                    progress("connected to %s (%s)", host.hostname,
                             "local" if local else f"ssh port {ssh.port}")
                return task

            errors = []
            with ThreadPoolExecutor(max_workers=len(used_hosts)) as pool:
                futures = [pool.submit(start_one, i) for i in range(len(used_hosts))]
                for i, fut in enumerate(futures):
                    try:
                        tasks[i] = fut.result()
                    except HvdliteError as exc:
                        errors.append(str(exc))
            if errors:
                raise HvdliteConfigError("; ".join(errors))
            progress("%d/%d hosts connected", len(tasks), len(tasks))

            # 2. registration, 3. routability
            driver.wait_for_tasks(deadline, tasks, stop=sig.stopped)
            progress("%d/%d tasks registered", len(tasks), len(tasks))
            iface, rdv_addr = driver.choose_interface(deadline, network_interfaces,
                                                      verbose=verbose)
            store = KVStoreService(key, bind_addr=rdv_addr)
            progress("using interface %s; rendezvous at %s:%d", iface, rdv_addr,
                     store.address[1])

            # 4. workers
            job_env = dict(job_env_extra)
            job_env.update({
                cfg.RENDEZVOUS_ADDR: rdv_addr,
                cfg.RENDEZVOUS_PORT: str(store.address[1]),
                cfg.JOB_ID: job_id,
                cfg.GLOO_IFACE: iface,
                cfg.CPU_OPERATIONS: job_env_extra.get(cfg.CPU_OPERATIONS) or "gloo",
            })
            driver.run_workers(list(command), job_env, deadline)
            progress("%d workers started on %d hosts", len(slots), len(tasks))

            # 5. wait
            failure, exit_code = driver.wait_for_workers(tasks, stop=sig.stopped)
            if sig.stopped.is_set() and failure is None:
                exit_code = 130
    except (HvdliteError, ServiceError, OSError) as exc:
        if sig.stopped.is_set():
            exit_code = 130
        else:
            failure = f"hvdlite-run: error: {exc}\n"
            exit_code = 1
    finally:
        _shutdown_tasks(driver, [t for t in tasks if t is not None])
        driver.shutdown()
        if store is not None:
            store.shutdown()
        sink.close()
    if failure:
        sys.stderr.write(failure)
        sys.stderr.flush()
    return exit_code


def _task_line(hostname: str, line: bytes) -> None:
    sys.stderr.buffer.write(f"[{hostname}]<task>:".encode() + line.rstrip(b"\n") + b"\n")
    sys.stderr.flush()


def _shutdown_tasks(driver, tasks) -> None:
    """Tell every task to end its workers, close their lifelines, and wait (bounded)."""
    driver.terminate_all(timeout_s=3.0)
    for t in tasks:
        t.close_stdin()
    deadline = time.monotonic() + TASK_SHUTDOWN_GRACE_S
    for t in tasks:
        if t.wait(max(0.0, deadline - time.monotonic())) is None:
            log.warning("the task on %s did not exit in %.0fs; cutting it off", t.hostname,
                        TASK_SHUTDOWN_GRACE_S)
            t.kill()
    for t in tasks:
        t.join_output(2.0)
