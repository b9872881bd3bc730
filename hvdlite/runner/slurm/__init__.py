"""The launcher's side of Slurm in one place: the allocation as a host source
(``allocation``), starting task services through ``srun`` (``srun_tasks``), and for a
plain ``srun`` step its job key (``key``); that step's job, which rank 0's child process
runs, is an entry point above the agent (``hvdlite.runner.step_job``).  The rank's side is
``hvdlite.common.slurm``.

May import ``hvdlite.runner.store``, ``tasks``, ``processes``, ``hosts`` and
``hvdlite.common``.
"""
