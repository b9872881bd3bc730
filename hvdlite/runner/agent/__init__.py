"""The job agent: every job is a host source x a starter x one loop.

* :mod:`.state_machine` -- the loop (:class:`~.state_machine.Agent`): rounds, failures,
  resets, success; a static job is the case "fixed hosts, no resets".
* :mod:`.job` -- :func:`~.job.run_job`: picks the source and the starter for a
  :class:`~hvdlite.runner.cli.launch_config.LaunchConfig` and builds the ranks' environment.
* :mod:`.settings` (sizes and failure policy), :mod:`.rounds` (the rendezvous store),
  :mod:`.hostset` (the blacklist), :mod:`.poller` (asks the source on a thread),
  :mod:`.blame` (whom a failure summary names).

Host sources live in ``hvdlite.runner.hosts``, starters in ``hvdlite.runner.starters``.
May import every package of ``hvdlite.runner`` but ``cli``, and ``hvdlite.common``.
"""
