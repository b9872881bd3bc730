"""Run one elastic job: wire discovery, the workers, the rendezvous store and the driver.

``launch.run`` calls :func:`launch_elastic` when any elastic flag is given.  Where
workers run is settled by the first round: when its hosts are all this machine
(``localhost``, ``127.0.0.1``, this host's names), the launcher starts them itself
and the rendezvous store listens on 127.0.0.1 only; otherwise (or when a fixed
host list names a remote host) every host gets a task service as in a static
multi-host job.  A job that started local-only refuses remote hosts discovery
offers later (the store is not reachable from them): the message says so.
"""

import logging
import os
import sys
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hvdlite.common import config as cfg
from hvdlite.common.net.framing import new_key
from hvdlite.runner.elastic.discovery import HostDiscovery
from hvdlite.runner.elastic.driver import ElasticDriver
from hvdlite.runner.elastic.settings import ElasticSettings
from hvdlite.runner.elastic.tasks import TaskWorkers
from hvdlite.runner.elastic.workers import LocalWorkers, SlotId, WorkerLauncher
from hvdlite.runner.hosts import HostSlots, SlotInfo, is_local
from hvdlite.runner.nics import loopback_interface
from hvdlite.runner.procs import StopSignals
from hvdlite.runner.rank_output import OutputSink
from hvdlite.runner.rendezvous import RendezvousService
from hvdlite.runner.ssh import SSHOptions

log = logging.getLogger(__name__)


class _Rounds:
    """The rendezvous store, made when the first round is published (its address is
    known only once the first round's hosts are prepared)."""

    def __init__(self, key: bytes, bind_addr: Callable[[], str]):
        self._key = key
        self._bind_addr = bind_addr
        self.service: Optional[RendezvousService] = None

    def publish(self, slots: Sequence[SlotInfo]) -> int:
        if self.service is None:
            self.service = RendezvousService(self._key, repeat_last=False,
                                             bind_addr=self._bind_addr())
        return self.service.publish(slots)

    @property
    def address(self) -> Tuple[str, int]:
        return self.service.address

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.shutdown()


class AutoWorkers(WorkerLauncher):
    """This machine's workers directly, or every host's through tasks (decided once)."""

    def __init__(self, make_local: Callable[[], WorkerLauncher],
                 make_tasks: Callable[[], WorkerLauncher], tasks_from_start: bool = False):
        self._make_local = make_local
        self._make_tasks = make_tasks
        self._impl: Optional[WorkerLauncher] = make_tasks() if tasks_from_start else None
        self._local_only = False

    def prepare(self, hosts: Sequence[HostSlots]) -> Dict[str, str]:
        if self._impl is None:
            self._local_only = all(is_local(h.hostname) for h in hosts)
            self._impl = self._make_local() if self._local_only else self._make_tasks()
            log.info("elastic job: %s", "every host is this machine: no SSH"
                     if self._local_only else "workers start through a task per host")
        if self._local_only:
            return {h.hostname: (
                "it is not this machine, and this job runs its workers and rendezvous store "
                "locally (every host of its first round was local); list a remote host in the "
                "first round to let remote hosts join") for h in hosts if not is_local(h.hostname)}
        return self._impl.prepare(hosts)

    @property
    def rendezvous_addr(self) -> str:
        return self._impl.rendezvous_addr

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        return self._impl.start(slots)

    def stop(self, ids: Sequence[SlotId]) -> None:
        if self._impl is not None:
            self._impl.stop(ids)

    def poll(self) -> List[Tuple[SlotId, int]]:
        return [] if self._impl is None else self._impl.poll()

    def stop_all(self) -> None:
        if self._impl is not None:
            self._impl.stop_all()

    def close(self) -> None:
        if self._impl is not None:
            self._impl.close()


def launch_elastic(settings: ElasticSettings, discovery: HostDiscovery, command: Sequence[str],
                   tunable_env: Dict[str, str], user_env: Dict[str, str],
                   forward_env: Dict[str, str], ssh: SSHOptions, start_timeout_s: float,
                   network_interfaces: Optional[List[str]] = None,
                   output_dir: Optional[str] = None, verbose: bool = False,
                   timestamp: bool = False, tasks_from_start: bool = False) -> int:
    """Run ``command`` as an elastic job; returns the exit code (0, the failure's, or 130).

    ``tasks_from_start``: a fixed host list names a remote host, so every host gets a task.
    """
    key = new_key()
    job_id = uuid.uuid4().hex[:12]
    sink = OutputSink(output_dir=output_dir, timestamp=timestamp)
    driver: Optional[ElasticDriver] = None

    def wake() -> None:
        if driver is not None:
            driver.wake()

    def job_env(with_key: bool) -> Dict[str, str]:
        env = dict(tunable_env)
        env.update(user_env)
        env.update({
            cfg.RENDEZVOUS_ADDR: rounds.address[0],
            cfg.RENDEZVOUS_PORT: str(rounds.address[1]),
            cfg.JOB_ID: job_id,
            cfg.CPU_OPERATIONS: "gloo",
            cfg.ELASTIC: "1",
            # a survivor waits this long for the round after a failure (as the driver does)
            cfg.ELASTIC_TIMEOUT: repr(float(settings.elastic_timeout_s)),
        })
        if with_key:                 # a task adds the key itself: it never crosses the wire
            env[cfg.SECRET_KEY] = key.hex()
            # local workers: Gloo's own (unauthenticated) listeners on loopback only
            env[cfg.GLOO_IFACE] = loopback_interface()
        return env

    workers = AutoWorkers(
        make_local=lambda: LocalWorkers(command, lambda: job_env(True), sink,
                                        base_env=dict(os.environ), on_exit=wake),
        make_tasks=lambda: TaskWorkers(key, job_id, command, lambda: job_env(False),
                                       forward_env, ssh, start_timeout_s, sink,
                                       network_interfaces=network_interfaces, on_exit=wake,
                                       verbose=verbose),
        tasks_from_start=tasks_from_start)
    rounds = _Rounds(key, lambda: workers.rendezvous_addr)
    driver = ElasticDriver(settings, discovery, workers, rounds)
    try:
        with StopSignals(driver.request_stop):
            code = driver.run()
    finally:
        workers.close()
        rounds.shutdown()
        sink.close()
    if driver.error:
        sys.stderr.write(f"hvdlite-run: error: {driver.error}\n")
        sys.stderr.flush()
    return code
