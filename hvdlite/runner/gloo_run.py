"""Static Gloo launch on this host: env per rank, start, stream output, propagate failures.

The launcher serves the job's authenticated rendezvous store, starts one
process per slot with the environment that rank needs, prefixes every output
line with its rank, and when any rank fails ends every other rank's whole
process tree and reports which rank failed and how.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence

import psutil

from hvdlite.common import config as cfg
from hvdlite.runner.hosts import SlotInfo
from hvdlite.runner.rendezvous import KVStoreService
from hvdlite.runner.secure import new_key

log = logging.getLogger(__name__)

TERMINATE_GRACE_S = 5.0


def slot_env(slot: SlotInfo, base_env: Dict[str, str], job_env: Dict[str, str]) -> Dict[str, str]:
    """The one place that builds a rank's environment."""
    env = dict(base_env)
    env.update(job_env)
    env.update(cfg.rank_env(slot.rank, slot.size, slot.local_rank, slot.local_size,
                            slot.cross_rank, slot.cross_size, slot.hostname))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class _OutputPump(threading.Thread):
    """Copies one stream of one rank to ours, a whole line at a time, with a prefix."""

    _lock = threading.Lock()

    def __init__(self, stream, rank: int, name: str, sink, log_file=None):
        super().__init__(name=f"output-rank{rank}-{name}", daemon=True)
        self._stream = stream
        self._prefix = f"[{rank}]<{name}>:".encode()
        self._sink = sink
        self._log_file = log_file

    def run(self):
        for line in iter(self._stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self._lock:
                self._sink.write(self._prefix + line)
                self._sink.flush()
            if self._log_file is not None:
                self._log_file.write(line)
                self._log_file.flush()
        self._stream.close()
        if self._log_file is not None:
            self._log_file.close()


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


class LocalJob:
    """The worker processes of one job on this host."""

    def __init__(self, slots: List[SlotInfo], command: Sequence[str], job_env: Dict[str, str],
                 output_dir: Optional[str] = None, verbose: bool = False):
        self.slots = slots
        self.command = list(command)
        self.job_env = job_env
        self.output_dir = output_dir
        self.verbose = verbose
        self.procs: List[subprocess.Popen] = []
        self._pumps: List[_OutputPump] = []
        self._stopping = threading.Event()

    def start(self) -> None:
        base = dict(os.environ)
        for slot in self.slots:
            env = slot_env(slot, base, self.job_env)
            proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            self.procs.append(proc)
            for name, stream, sink in (("stdout", proc.stdout, sys.stdout.buffer),
                                       ("stderr", proc.stderr, sys.stderr.buffer)):
                log_file = None
                if self.output_dir:
                    rank_dir = os.path.join(self.output_dir, f"rank.{slot.rank}")
                    os.makedirs(rank_dir, exist_ok=True)
                    log_file = open(os.path.join(rank_dir, name), "wb")
                pump = _OutputPump(stream, slot.rank, name, sink, log_file)
                pump.start()
                self._pumps.append(pump)
            if self.verbose:
                log.warning("started rank %d on %s as pid %d", slot.rank, slot.hostname, proc.pid)

    def wait(self) -> int:
        """Wait for all ranks; on the first failure end the rest. Returns the exit code."""
        failure = None
        while True:
            running = 0
            for slot, proc in zip(self.slots, self.procs):
                code = proc.poll()
                if code is None:
                    running += 1
                elif code != 0 and failure is None:
                    failure = (slot, code)
            if failure is not None or running == 0 or self._stopping.is_set():
                break
            time.sleep(0.05)
        if failure is not None or self._stopping.is_set():
            self.terminate()
        for pump in self._pumps:
            pump.join(timeout=5)
        if self._stopping.is_set() and failure is None:
            return 130
        if failure is not None:
            slot, code = failure
            how = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                   else f"exited with code {code}")
            sys.stderr.write(f"hvdlite-run: rank {slot.rank} on host {slot.hostname} {how}; "
                             f"the other ranks were terminated.\n")
            sys.stderr.flush()
            return code if code > 0 else 128 - code
        return 0

    def terminate(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    kill_tree(psutil.Process(proc.pid))
                except psutil.NoSuchProcess:
                    pass
            try:
                proc.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                pass

    def request_stop(self) -> None:
        self._stopping.set()


def launch_local(slots: List[SlotInfo], command: Sequence[str], tunable_env: Dict[str, str],
                 output_dir: Optional[str] = None, verbose: bool = False) -> int:
    """Run ``command`` once per slot on this host through Gloo; returns the exit code."""
    key = new_key()
    store = KVStoreService(key, bind_addr="127.0.0.1")
    job_env = dict(tunable_env)
    job_env.update({
        cfg.RENDEZVOUS_ADDR: store.address[0],
        cfg.RENDEZVOUS_PORT: str(store.address[1]),
        cfg.SECRET_KEY: key.hex(),
        cfg.JOB_ID: uuid.uuid4().hex[:12],
        cfg.CPU_OPERATIONS: tunable_env.get(cfg.CPU_OPERATIONS) or "gloo",
    })
    job = LocalJob(slots, command, job_env, output_dir=output_dir, verbose=verbose)

    def on_signal(signum, frame):
        sys.stderr.write(f"hvdlite-run: received {signal.Signals(signum).name}; "
                         f"terminating all ranks.\n")
        job.request_stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        job.start()
        return job.wait()
    finally:
        job.terminate()
        for s, h in old.items():
            signal.signal(s, h)
        store.shutdown()
