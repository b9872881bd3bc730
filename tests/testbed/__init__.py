"""A testbed of hosts on one machine: network namespaces joined by a switch, each host with
its own address, name and sshd, and links that can be shaped, made lossy or cut.

See :mod:`tests.testbed.hosts` (the :class:`Testbed` class and the pytest fixture's
helpers) and ``python -m tests.testbed`` (the same for benchmarks and by hand).
"""

from tests.testbed.hosts import Testbed, TestbedUnavailable, sweep_stale  # noqa: F401
