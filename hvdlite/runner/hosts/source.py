"""Host sources: which hosts (and how many slots on each) a job may use right now.

The agent (:mod:`hvdlite.runner.agent`) asks its source about once a second on
a thread of its own.  A source is one small module implementing
:class:`HostSource`: :mod:`.fixed` (``-H`` / ``--hostfile``), :mod:`.script`
(``--host-discovery-script``), and the engines' own (Ray nodes in
``hvdlite.ray.elastic_workers``).  A source that cannot answer raises
:class:`HostDiscoveryError`; the agent logs it and keeps the hosts it had.
"""

import abc
from typing import List

from hvdlite.common.exceptions import HvdliteLaunchError
from hvdlite.runner.hosts.slots import HostSlots


class HostDiscoveryError(HvdliteLaunchError):
    """Host discovery gave no usable answer; ``output`` is what the script printed."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


class HostSource(abc.ABC):
    """A source of the currently available hosts (one module per kind of source).

    :meth:`find` runs on the agent's poller thread, never on the agent's own;
    :meth:`close` may be called from any thread to end a :meth:`find` in progress.
    """

    #: False when the answer can never change (the driver then need not wait for it to)
    can_change = True

    @abc.abstractmethod
    def find(self) -> List[HostSlots]:
        """The hosts available now, in the order new slots should be filled.

        Raises:
            HostDiscoveryError: no usable answer this time (the caller keeps the last one).
        """

    def close(self) -> None:
        """End whatever a running :meth:`find` is waiting on (default: nothing)."""
