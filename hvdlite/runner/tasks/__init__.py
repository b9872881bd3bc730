"""The launcher's reach onto other hosts: SSH (or ``--launcher-agent``), the driver
service and the task service each remote host runs, their heartbeats, and the
process that runs one rank of ``hvdlite.run``'s function.

May import ``hvdlite.runner.processes``, ``hvdlite.runner.hosts`` and ``hvdlite.common``.
"""
