"""What the ranks tell the launcher, kept in the launcher: the rendezvous store (rounds
and places), exit reports, the metrics inbox and its ``/metrics`` endpoint, and the
ranks' stack reports.

May import ``hvdlite.runner.hosts``, ``hvdlite.runner.processes`` and ``hvdlite.common``;
nothing else of the runner.
"""
