"""The launcher's side of Slurm in one place: the allocation as a host source
(``allocation``), starting task services through ``srun`` (``srun_tasks``), and for a
plain ``srun`` step its job key (``key``) and its job, which rank 0's child process runs
(``step_job``).  The rank's side is ``hvdlite.common.slurm``.

May import ``hvdlite.runner.store``, ``tasks``, ``processes``, ``hosts`` and
``hvdlite.common``.
"""
