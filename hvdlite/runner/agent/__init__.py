"""The job agent: every job is a host source x a starter x one loop.

* :mod:`.state_machine` -- the loop (:class:`~.state_machine.Agent`): rounds, failures,
  resets, success; a static job is the case "fixed hosts, no resets".
* :mod:`.spec` -- :class:`~.spec.JobSpec` in, :class:`~.spec.JobResult` out.
* :mod:`.job` -- :func:`~.job.run_job`, the only way a job runs and the only place the
  loop is made: key, job id, store, the ranks' environment, stop signals, the failure
  summary; the host source and the starter from the spec (a platform's own, or fixed
  hosts / a discovery script with local processes, SSH tasks or mpiexec).
* :mod:`.settings` (sizes and failure policy), :mod:`.rounds` (the rendezvous store),
  :mod:`.hostset` (the blacklist), :mod:`.poller` (asks the source on a thread),
  :mod:`.settling` (a host that appears in discovery is used once it stays listed),
  :mod:`.blame` (whom a failure summary names).

Host sources live in ``hvdlite.runner.hosts``, starters in ``hvdlite.runner.starters``.
May import every package of ``hvdlite.runner`` but ``cli``, and ``hvdlite.common``.
"""
