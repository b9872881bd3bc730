"""Hosts and slots from the Slurm allocation ``hvdlite-run`` runs inside (``salloc``/``sbatch``).

``SLURM_JOB_NODELIST`` (hostlist form, ``node[01-04,07]``) and ``SLURM_TASKS_PER_NODE``
(``2(x3),1``) give each node and how many ranks it takes; the parsing is in
:mod:`hvdlite.common.slurm.environment` (a rank of a plain ``srun`` step reads the same variables).
``hvdlite-run`` with neither ``-H`` nor ``--hostfile`` uses them, ``-np`` defaulting to their
total; the task services of the allocation's other nodes then start through ``srun``
(:mod:`hvdlite.runner.slurm.srun_tasks`), not SSH.
"""

import os
import shutil
from typing import List, Mapping, Optional, Sequence

from hvdlite.common.slurm import environment as slurm
from hvdlite.runner.hosts.slots import HostSlots

#: set in every process of a Slurm job (the allocation's id)
JOB_ID_VARIABLES = ("SLURM_JOB_ID", "SLURM_JOBID")


def allocation_hosts(environ: Optional[Mapping[str, str]] = None) -> Optional[List[HostSlots]]:
    """The allocation's nodes with their task counts as slots; None outside an allocation.

    Raises:
        HvdliteConfigError: a Slurm variable does not parse (names it).
    """
    env = os.environ if environ is None else environ
    if not any(env.get(v) for v in JOB_ID_VARIABLES):
        return None
    pairs = slurm.allocation(env)
    return None if pairs is None else [HostSlots(node, tasks) for node, tasks in pairs]


def describe(environ: Optional[Mapping[str, str]] = None) -> str:
    """Where the hosts came from, for the launcher's message (``SLURM_JOB_NODELIST=...``)."""
    env = os.environ if environ is None else environ
    parts = [
        f"{v}={env[v]}"
        for v in (slurm.NODELIST_VARIABLES + (slurm.TASKS_PER_NODE_VARIABLE,))
        if env.get(v)
    ]
    return ", ".join(parts[-2:])


def srun_reaches(hostnames: Sequence[str], environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``srun`` can start tasks on all of ``hostnames``: we are inside an allocation
    that holds each of them, and ``srun`` is on PATH."""
    hosts = allocation_hosts(environ)
    if not hosts or shutil.which("srun") is None:
        return False
    nodes = {h.hostname for h in hosts}
    return all(name in nodes for name in hostnames)
