"""Starters: how a job's workers are started, stopped and watched -- the interface.

The agent names a worker by its :data:`~hvdlite.runner.hosts.SlotId` -- (host name, local slot) --
which is also how the rendezvous store knows it; one process keeps its slot id
for its whole life, whatever rank later rounds give it.  A slot id is used again
only after its previous process has exited (a host back from the blacklist).

:class:`Starter` is what the agent needs: get hosts ready, start workers on
slots, stop some, and report exits.  Each kind is one small module beside this
one: :mod:`.local` (child processes of the launcher), :mod:`.ssh_tasks` (a task
service per host, over SSH for remote hosts), :mod:`.mpiexec` (one ``mpiexec``
for the whole job), :mod:`.auto` (local or tasks, decided by the first round);
Ray's actors are in ``hvdlite.ray.elastic_workers``.
"""

import abc
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvdlite.runner.hosts import HostSlots, SlotId, SlotInfo
from hvdlite.runner.processes.py_spy import OutsideStack

log = logging.getLogger(__name__)


class Starter(abc.ABC):
    """Starts, stops and watches the workers of a job.

    Every method is called from the agent's thread, but :meth:`outside_stacks`, which any
    thread may call while the others run; ``on_exit`` (given to the constructor of an
    implementation) may be called from any thread whenever a worker exits, so that the
    agent wakes at once.
    """

    #: whether the job's workers meet through the launcher's rendezvous store (Gloo);
    #: False for a starter whose workers find each other another way (mpiexec)
    needs_rendezvous = True
    #: what the launcher says it does on SIGINT/SIGTERM
    stop_action = "terminating all ranks"

    def prepare(self, hosts: Sequence[HostSlots]) -> Dict[str, str]:
        """Make these hosts ready to take workers; returns ``{host name: why not}`` for
        the hosts that cannot (the agent blacklists them).  Default: every host is ready.

        Raises:
            HvdliteLaunchError: a job-level problem no other host can fix (the agent
                fails the job with this message).
        """
        return {}

    @property
    def rendezvous_addr(self) -> str:
        """The address the rendezvous store must listen on (valid after :meth:`prepare`)."""
        return "127.0.0.1"

    @abc.abstractmethod
    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        """Start one worker per slot; returns ``{slot id: why}`` for the workers that could
        not be started (every other one runs, and its exit will be reported)."""

    @abc.abstractmethod
    def stop(self, ids: Sequence[SlotId]) -> None:
        """End these workers' process trees; returns at once, their exits come through
        :meth:`poll`."""

    @abc.abstractmethod
    def poll(self) -> List[Tuple[SlotId, int]]:
        """Workers that exited since the last call, with their exit codes."""

    @abc.abstractmethod
    def stop_all(self) -> None:
        """End every worker on every host and wait for them (bounded)."""

    def close(self) -> None:
        """Release what :meth:`stop_all` left (services, connections).  Default: nothing."""

    def suspended(self) -> List[SlotId]:
        """Workers whose process is alive but stopped (SIGSTOP, a debugger): they cannot
        answer their peers.  Asked only when a job fails, to name the cause.  Default:
        none known."""
        return []

    def results(self) -> Dict[SlotId, Any]:
        """What each worker returned, by slot, for starters whose workers are function
        calls (Ray actors, Spark tasks).  Default: nothing (a process returns no value)."""
        return {}

    def failures(self) -> Dict[SlotId, str]:
        """Why workers failed as the starter saw it (a call's traceback, an actor's death),
        by slot, in the order they failed.  Default: nothing (a process's exit report
        reaches the store instead)."""
        return {}

    def outside_stacks(self, ids: Sequence[SlotId], timeout_s: float) -> Dict[SlotId, OutsideStack]:
        """Stacks taken from outside the rank's process, by py-spy on the host that runs it
        (``hvdlite.runner.processes.py_spy``): they need nothing of the rank, so they show a
        program that runs no hvdlite runtime and a rank whose interpreter lock a C call
        holds.  Returns within about ``timeout_s``, by slot, an entry for each of ``ids``
        that has a live worker here (its ``note`` says why it has no threads); called from
        any thread (a stack report's, a watchdog's), never raises.  Default: ``{}`` (this
        starter cannot reach its workers' processes)."""
        return {}

    def cut_links(self, hosts: Sequence[str]) -> List[Tuple[str, str]]:
        """Pairs of ``hosts`` that cannot reach each other, probed now between the hosts
        (a partial partition: both may still reach the launcher); each pair in the order
        of ``hosts``.  Bounded by a few seconds.  Default: none known (workers that are
        children of the launcher share its host)."""
        return []

    def describe_failure(self, sid: SlotId, code: int) -> Optional[str]:
        """A whole summary line for a failure, for starters that cannot tell ranks apart
        (mpiexec); None (the default): the agent names the rank itself."""
        return None
