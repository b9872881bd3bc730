"""Static Gloo launch: env per rank, start, stream output, propagate failures.

Two entry points, both starting and ending ranks through :mod:`hvdlite.runner.procs`:

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
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteError, HvdliteLaunchError
from hvdlite.common.net.framing import new_key
from hvdlite.runner.driver import Driver
from hvdlite.runner.hosts import HostSlots, SlotInfo, is_local
from hvdlite.runner.nics import loopback_interface
from hvdlite.runner.procs import StopSignals, WorkerGroup, exit_status, failure_message
from hvdlite.runner.rank_output import OutputSink
from hvdlite.runner.rendezvous import RendezvousService
from hvdlite.runner.ssh import SSHOptions, start_task

log = logging.getLogger(__name__)

#: how long tasks get to end their workers after a failure before we cut them off
TASK_SHUTDOWN_GRACE_S = 10.0


def launch_local(slots: List[SlotInfo], command: Sequence[str], tunable_env: Dict[str, str],
                 output_dir: Optional[str] = None, verbose: bool = False,
                 timestamp: bool = False, extra_env: Optional[Dict[str, str]] = None) -> int:
    """Run ``command`` once per slot on this host through Gloo; returns the exit code."""
    key = new_key()
    store = RendezvousService(key, slots, bind_addr="127.0.0.1")
    job_env = dict(tunable_env)
    job_env.update(extra_env or {})
    job_env.update({
        cfg.RENDEZVOUS_ADDR: store.address[0],
        cfg.RENDEZVOUS_PORT: str(store.address[1]),
        cfg.SECRET_KEY: key.hex(),
        cfg.JOB_ID: uuid.uuid4().hex[:12],
        cfg.CPU_OPERATIONS: tunable_env.get(cfg.CPU_OPERATIONS) or "gloo",
        # Gloo's own (unauthenticated) listeners on loopback only, like the store
        cfg.GLOO_IFACE: loopback_interface(),
    })
    sink = OutputSink(output_dir=output_dir, timestamp=timestamp)
    group = WorkerGroup(slots, command, job_env, sink)
    wake = threading.Event()
    failure = None
    left_early: Optional[SlotInfo] = None     # the first rank that exited 0
    silent: Optional[SlotInfo] = None         # a stopped rank when another one failed
    try:
        with StopSignals(wake.set) as sig:
            group.start()
            if verbose:
                log.warning("started %d ranks on this host", len(slots))
            while not sig.stopped.is_set():
                for slot, code in group.poll():
                    if code != 0 and failure is None:
                        failure = (slot, code)
                    elif code == 0 and failure is None and left_early is None:
                        left_early = slot
                if failure is not None:
                    silent = next(iter(group.stopped_slots()), None)
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
        sys.stderr.write(failure_message(
            slot.rank, slot.hostname, code,
            left_early=(left_early.rank, left_early.hostname) if left_early else None,
            stopped=(silent.rank, silent.hostname) if silent else None,
            op_timeout_s=_op_timeout(tunable_env)))
        sys.stderr.flush()
        return exit_status(code)
    if stopped:
        return 130
    return 0


# ----------------------------------------------------------------------------------------
# multi-host


def launch_multi(hosts: List[HostSlots], slots: List[SlotInfo], command: Sequence[str],
                 job_env_extra: Dict[str, str], forward_env: Dict[str, str], ssh: SSHOptions,
                 start_timeout_s: float, network_interfaces: Optional[List[str]] = None,
                 output_dir: Optional[str] = None, verbose: bool = False,
                 timestamp: bool = False) -> int:
    """Run a job whose hosts include at least one remote one; returns the exit code.

    ``forward_env`` is the allow-listed environment that every host's workers get.
    """

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
    sig = StopSignals(driver.wake)
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
                raise HvdliteLaunchError("; ".join(errors))
            progress("%d/%d hosts connected", len(tasks), len(tasks))

            # 2. registration, 3. routability
            driver.wait_for_tasks(deadline, tasks, stop=sig.stopped)
            progress("%d/%d tasks registered", len(tasks), len(tasks))
            iface, rdv_addr = driver.choose_interface(deadline, network_interfaces,
                                                      verbose=verbose)
            store = RendezvousService(key, slots, bind_addr=rdv_addr)
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
            failure, exit_code = driver.wait_for_workers(
                tasks, stop=sig.stopped, op_timeout_s=_op_timeout(job_env_extra))
            if sig.stopped.is_set() and failure is None:
                exit_code = 130
    except (HvdliteError, OSError) as exc:
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


def _op_timeout(tunable_env: Dict[str, str]) -> Optional[float]:
    """The ranks' --op-timeout-seconds, for the message about a silent rank."""
    try:
        return cfg.Config.from_env(
            {k: v for k, v in tunable_env.items() if k == cfg.OP_TIMEOUT}, warn=False
        ).op_timeout_s
    except HvdliteError:
        return None


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
