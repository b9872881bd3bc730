"""Worker processes: start them, watch them, end their whole trees, describe their exits.

One module for every launch path: the local Gloo launcher and each host's task
start ranks through :class:`WorkerGroup`; MPI mode and the tasks' local
processes are cut off with :func:`kill_tree`; exits are described the same
way everywhere (:func:`describe_exit`, :func:`exit_status`).
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import psutil

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteLaunchError
from hvdlite.runner.processes import lifeline

log = logging.getLogger(__name__)

#: how long a process tree gets between SIGTERM and SIGKILL
TERMINATE_GRACE_S = 5.0


def describe_exit(code: int) -> str:
    """``exited with code N`` or ``was killed by signal NAME`` for a Popen return code."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    """Our own exit status for a failed rank's code (signals map to 128+N)."""
    return code if code > 0 else 128 - code


def failure_message(
    rank: int,
    host: str,
    code: int,
    left_early: Optional[Tuple[int, str]] = None,
    stopped: Optional[Tuple[int, str]] = None,
    op_timeout_s: Optional[float] = None,
) -> str:
    """The launcher's one line about the rank that failed the job.

    The rank that exits non-zero first is often only the one that *noticed*: its
    collective failed because a peer left (``left_early``: it exited 0 before its peers
    finished) or went silent (``stopped``: its process is stopped, e.g. by SIGSTOP).  The
    line then names that peer first and what was seen, and the noticing rank second.
    """
    then = f"rank {rank} on host {host} then failed ({describe_exit(code)})"
    if stopped is not None:
        waited = (
            f" for {op_timeout_s:g}s (--op-timeout-seconds)" if op_timeout_s is not None else ""
        )
        return (
            f"hvdlite-run: rank {stopped[0]} on host {stopped[1]} stopped answering"
            f"{waited}: its process is stopped (SIGSTOP or a debugger); {then}; "
            f"the other ranks were terminated.\n"
        )
    if left_early is not None:
        return (
            f"hvdlite-run: rank {left_early[0]} on host {left_early[1]} exited with code 0 "
            f"before its peers finished; {then}; the other ranks were terminated.\n"
        )
    return (
        f"hvdlite-run: rank {rank} on host {host} {describe_exit(code)}; "
        f"the other ranks were terminated.\n"
    )


def slot_env(slot, base_env: Dict[str, str], job_env: Dict[str, str]) -> Dict[str, str]:
    """A rank's environment: ``job_env`` (what every rank of the job shares, built by the
    agent's ``run_job``) over ``base_env``, and the place of ``slot`` (a
    ``hvdlite.runner.hosts.SlotInfo``) under our names and Horovod's.

    Unless the user set ``OMP_NUM_THREADS``, each rank gets this host's cores divided by
    its ranks on the host, as torchrun does: N ranks each running as many math threads as
    there are cores oversubscribe the machine and slow every rank down.
    """
    env = dict(base_env)
    env.update(job_env)
    place = {
        cfg.RANK: slot.rank,
        cfg.SIZE: slot.size,
        cfg.LOCAL_RANK: slot.local_rank,
        cfg.LOCAL_SIZE: slot.local_size,
        cfg.CROSS_RANK: slot.cross_rank,
        cfg.CROSS_SIZE: slot.cross_size,
        cfg.HOSTNAME: slot.hostname,
    }
    env.update({name: str(value) for name, value in place.items()})
    env.update({cfg.HOROVOD_ALIASES[name]: str(value) for name, value in place.items()})
    if cfg.TORCH_MASTER_PORT in job_env:  # the job serves torch's store: torchrun's place
        env.update(torch_place(slot))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // slot.local_size)))
    return env


def torch_place(slot) -> Dict[str, str]:
    """The place of ``slot`` under torchrun's names (one role, no restarts)."""
    place = {
        cfg.TORCH_RANK: slot.rank,
        cfg.TORCH_WORLD_SIZE: slot.size,
        cfg.TORCH_LOCAL_RANK: slot.local_rank,
        cfg.TORCH_LOCAL_WORLD_SIZE: slot.local_size,
        cfg.TORCH_GROUP_RANK: slot.host_index,
        cfg.TORCH_GROUP_WORLD_SIZE: slot.host_count,
        cfg.TORCH_ROLE_RANK: slot.rank,
        cfg.TORCH_ROLE_WORLD_SIZE: slot.size,
    }
    return {name: str(value) for name, value in place.items()}


def kill_tree(proc: psutil.Process, grace_s: float = TERMINATE_GRACE_S) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL what is left (bounded)."""
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
            p.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only now
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


class OutputTarget(Protocol):
    """Where worker output goes (``hvdlite.runner.processes.rank_output.OutputSink``)."""

    def attach(self, rank: int, stream: str, pipe: IO[bytes]) -> threading.Thread:
        """Start a thread that forwards each line of ``pipe`` as ``rank``'s ``stream``."""


class WorkerGroup:
    """The worker processes of one job on this host (used by the launcher and by tasks)."""

    def __init__(
        self,
        slots: Sequence,
        command: Sequence[str],
        job_env: Dict[str, str],
        sink: OutputTarget,
        base_env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
    ):
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
            HvdliteLaunchError: the command cannot be started (names the rank and host).
        """
        for slot in self.slots:
            env = slot_env(slot, self.base_env, self.job_env)
            with self._lock:
                if self._terminated:
                    return
                try:
                    # a session of its own (tree kills reach its children), tied to our
                    # life: if we die, even by SIGKILL, the kernel kills the rank
                    proc = lifeline.popen(
                        self.command,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                        cwd=self.cwd,
                    )
                except OSError as exc:
                    raise HvdliteLaunchError(
                        f"rank {slot.rank} on host {slot.hostname}: cannot start "
                        f"{self.command[0]!r}: {exc.strerror}"
                    ) from None
                self.procs.append(proc)
            self._pumps += [
                self.sink.attach(slot.rank, "stdout", proc.stdout),
                self.sink.attach(slot.rank, "stderr", proc.stderr),
            ]
            log.info("started rank %d on %s as pid %d", slot.rank, slot.hostname, proc.pid)

    def poll(self) -> List[Tuple[object, int]]:
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

    def stopped_slots(self) -> list:
        """Ranks whose process is alive but stopped (SIGSTOP, SIGTSTP, a debugger): they
        cannot answer their peers, whose collectives then time out."""
        out = []
        for slot, proc in zip(self.slots, list(self.procs)):
            if proc.poll() is not None:
                continue
            try:
                status = psutil.Process(proc.pid).status()
            except psutil.Error:
                continue
            if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                out.append(slot)
        return out

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


class StopSignals:
    """While installed, SIGINT/SIGTERM become a stop request instead of killing the launcher.

    The first signal prints ``hvdlite-run: received SIGNAME; <action>.``; every
    signal sets :attr:`stopped` and calls ``on_stop``.  Installed only on the
    main thread (elsewhere Python cannot set handlers; the context is then inert).
    """

    def __init__(self, on_stop: Callable[[], None], action: str = "terminating all ranks"):
        self.stopped = threading.Event()
        self._on_stop = on_stop
        self._action = action
        self._old = {}

    def __enter__(self) -> "StopSignals":
        def handler(signum, frame):
            if not self.stopped.is_set():
                sys.stderr.write(
                    f"hvdlite-run: received {signal.Signals(signum).name}; {self._action}.\n"
                )
                sys.stderr.flush()
            self.stopped.set()
            self._on_stop()

        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def terminate_groups(groups: Sequence["WorkerGroup"]) -> None:
    """End several worker groups at once (each tree kill waits out its own grace period, so
    in parallel), then collect their last output."""
    threads = [
        threading.Thread(target=g.terminate, name="terminate-workers", daemon=True) for g in groups
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in groups:
        g.join_output(2.0)
