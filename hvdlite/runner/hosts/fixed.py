"""The fixed host source: the ``-H`` / ``--hostfile`` list, never changing.

A static job uses it with exactly the slots it needs; an elastic job given a
fixed list only survives failures (nothing new ever joins).
"""

from typing import List

from hvdlite.runner.hosts.slots import HostSlots
from hvdlite.runner.hosts.source import HostSource


class FixedHosts(HostSource):
    """The hosts of ``-H``/``--hostfile``: always the same answer."""

    can_change = False

    def __init__(self, hosts: List[HostSlots]):
        self._hosts = list(hosts)

    def find(self) -> List[HostSlots]:
        return list(self._hosts)
