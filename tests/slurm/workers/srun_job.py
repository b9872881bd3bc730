"""A job whose every task service starts through srun, this node's too (on the one-node
test cluster the launcher would otherwise start local children): run inside salloc as
``python -m tests.slurm.workers.srun_job COMMAND...``; exits with the job's code."""

import sys

from hvdlite.runner.agent.job import JobContext, rank_env, run_agent
from hvdlite.runner.agent.settings import JobSettings
from hvdlite.runner.slurm import allocation as slurm_hosts
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.cli.launch_config import LaunchConfig
from hvdlite.runner.processes.rank_output import OutputSink
from hvdlite.runner.tasks.ssh import SSHOptions
from hvdlite.runner.slurm.srun_tasks import task_opener
from hvdlite.runner.starters.ssh_tasks import TaskWorkers


def main() -> int:
    hosts = slurm_hosts.allocation_hosts()
    np = sum(h.slots for h in hosts)
    config = LaunchConfig(np=np, hosts=hosts, command=sys.argv[1:], start_timeout_s=60.0)
    job = JobContext(config, JobSettings.static_job(np))
    sink = OutputSink()
    starter = TaskWorkers(job.key, job.job_id, config.command,
                          lambda: rank_env(job, local=False), config.forward_env(),
                          SSHOptions(), config.start_timeout_s, sink, on_exit=job.wake,
                          open_task=task_opener(local_too=True))
    try:
        return run_agent(job, FixedHosts(hosts), starter)
    finally:
        sink.close()


if __name__ == "__main__":
    sys.exit(main())
