"""Starters: how a job's workers are started, stopped and watched (``base`` is the
interface): child processes of the launcher (``local``), a task service per host
(``ssh_tasks``), one ``mpiexec`` for the whole job (``mpiexec``), or local-or-tasks
decided by the first round (``auto``).  The ``srun`` starter is in
``hvdlite.runner.slurm``; Ray's and Spark's live with their platforms.

May import ``hvdlite.runner.tasks``, ``slurm``, ``store``, ``hosts``, ``processes`` and
``hvdlite.common``; never the agent or the command line.
"""
