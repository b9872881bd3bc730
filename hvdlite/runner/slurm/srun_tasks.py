"""Task services started through ``srun`` inside a Slurm allocation, instead of SSH.

One ``srun`` per node runs a one-task step (``--nodes=1 --ntasks=1 -w NODE``) that is the
node's task service (:mod:`hvdlite.runner.tasks.task_service`).  ``--overlap`` lets the
step share the node's CPUs with the job's other steps (and with the workers the task
starts), ``--cpu-bind=none`` keeps it from being pinned to one core, ``--mpi=none`` keeps
MPI plugins out, and ``--kill-on-bad-exit=1`` ends the step if the task fails.  ``--exact``
is left out on purpose: it would confine the step, and so every worker the task starts, to
the one CPU its one task asks for.  The task's start-up payload (with the job key) goes to
srun's stdin, which srun forwards; stdin stays open as the task's lifeline, as over SSH.  Killing srun (which the launcher's death does,
through the parent-death signal) ends the step and so the task and its workers.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from typing import Callable, Dict, List

from hvdlite.common.exceptions import HvdliteLaunchError
from hvdlite.runner.processes import lifeline
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.tasks.ssh import TASK_MODULE, LocalTask, TaskProcess

log = logging.getLogger(__name__)

#: the flags of every task step (checked against Slurm 22.05's srun)
SRUN_FLAGS = (
    "--nodes=1",
    "--ntasks=1",
    "--overlap",
    "--cpu-bind=none",
    "--mpi=none",
    "--kill-on-bad-exit=1",
    "--job-name=hvdlite-task",
    "--quiet",
)


def srun_command(node: str, python: str = sys.executable, srun: str = "srun") -> List[str]:
    """The command line that starts ``node``'s task service as a one-task step."""
    return [
        srun,
        *SRUN_FLAGS,
        f"--nodelist={node}",
        f"--chdir={os.getcwd()}",
        python,
        "-m",
        TASK_MODULE,
    ]


class SrunTask(LocalTask):
    """A node's task service, as the ``srun`` child of this process that runs it."""

    def __init__(self, host: HostSlots, payload: bytes, python: str = sys.executable):
        self.hostname = host.hostname
        srun = shutil.which("srun")
        if srun is None:
            raise HvdliteLaunchError(f"host {host.hostname}: srun is not on PATH")
        # SIGTERM to srun if we die: srun then ends the step, the task and its workers
        self._proc = lifeline.popen(
            srun_command(host.hostname, python, srun),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            death_signal=signal.SIGTERM,
        )
        self._proc.stdin.write(payload)
        self._proc.stdin.flush()
        log.info("task of %s started through srun (pid %d)", host.hostname, self._proc.pid)


def task_opener(local_too: bool = False) -> Callable[[HostSlots, bool, Dict, float], TaskProcess]:
    """What :class:`~hvdlite.runner.starters.ssh_tasks.TaskStarter` starts a host's task
    with: ``srun`` for the allocation's other nodes, a plain child for this machine
    (``local_too``: srun for this machine as well, as the tests do on one node)."""

    def open_task(host: HostSlots, local: bool, payload: Dict, timeout_s: float) -> TaskProcess:
        data = (json.dumps(payload) + "\n").encode()
        if local and not local_too:
            return LocalTask(host, data, sys.executable)
        return SrunTask(host, data)

    return open_task
