"""A job whose every task service starts through srun, this node's too (on the one-node
test cluster the launcher would otherwise start local children): run inside salloc as
``python -m tests.slurm.workers.srun_job COMMAND...``; exits with the job's code."""

import sys

from hvdlite.runner.agent import rank_env
from hvdlite.runner.agent.job import run_job
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.processes.rank_output import OutputSink
from hvdlite.runner.slurm import allocation as slurm_hosts
from hvdlite.runner.slurm.srun_tasks import task_opener
from hvdlite.runner.starters.ssh_tasks import TaskStarter
from hvdlite.runner.tasks.ssh import SSHOptions


def main() -> int:
    hosts = slurm_hosts.allocation_hosts()
    np = sum(h.slots for h in hosts)
    sink = OutputSink()

    def starter(job):
        return TaskStarter(
            job.key,
            job.job_id,
            job.spec.command,
            lambda: job.job_env(local=False),
            rank_env.forward_env(job.spec),
            SSHOptions(),
            job.spec.start_timeout_s,
            sink,
            on_exit=job.wake,
            open_task=task_opener(local_too=True),
        )

    spec = JobSpec(np=np, hosts=hosts, command=sys.argv[1:], starter=starter).with_start_timeout(
        60.0
    )
    try:
        return run_job(spec).exit_code
    finally:
        sink.close()


if __name__ == "__main__":
    sys.exit(main())
