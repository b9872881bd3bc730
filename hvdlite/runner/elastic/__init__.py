"""Elastic jobs (``hvdlite-run --min-np/--max-np/--host-discovery-script``).

Modules, one job each: ``settings`` (the flags, checked), ``discovery`` (which
hosts exist now), ``poller`` (asks it
on a thread), ``hostset`` (the blacklist), ``workers`` (where workers run:
this machine), ``tasks`` (or each host's task service), ``driver`` (the state
machine that turns hosts into rendezvous rounds) and ``run`` (wires them up for
``launch.run``).  docs/architecture.md, "Elastic jobs", describes the whole.
"""
