"""The launcher's side of Slurm in one place: the allocation as a host source
(``allocation``), starting task services through ``srun`` (``srun_tasks``), and the
job key and store for a plain ``srun`` step (``key``, ``store``).  The rank's side is
``hvdlite.common.slurm``.

May import ``hvdlite.runner.store``, ``tasks``, ``processes``, ``hosts`` and
``hvdlite.common``.
"""
