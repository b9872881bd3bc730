"""A rank under Slurm: reading the step's environment (``environment``) and, under a
plain ``srun`` without ``hvdlite-run``, learning its place from the step
(``srun_step``).  The launcher's side of Slurm is ``hvdlite.runner.slurm``.

May import ``hvdlite.common.config``, ``exceptions`` and ``backend``.
"""
