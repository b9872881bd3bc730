"""Run one job: ``run_job(JobSpec) -> JobResult``, the only place the agent is made.

Whatever starts a job -- ``hvdlite-run``, ``hvdlite.run``, ``hvdlite.ray``,
``hvdlite.spark`` -- builds a :class:`~hvdlite.runner.agent.spec.JobSpec` and calls
:func:`run_job`.  It owns what every job needs: the job's key and id, its rendezvous
store, the environment every rank shares (:meth:`JobContext.job_env`, built by
``rank_env``), SIGINT/SIGTERM as a stop
request, ``--dump-stacks`` / SIGUSR1, the ``/metrics`` endpoint and the failure summary
that names the rank that failed first.  A platform brings a host source and a starter;
without them the spec's hosts (or discovery script) and local processes, SSH tasks or
mpiexec are used.
"""

import dataclasses
import logging
import os
import sys
import uuid
from typing import Dict, List, Optional

from hvdlite.common.diagnostics import flight_recorder
from hvdlite.common.net.framing import new_key
from hvdlite.runner.agent.rounds import Rounds
from hvdlite.runner.agent.settling import settled
from hvdlite.runner.agent import rank_env
from hvdlite.runner.agent.spec import JobResult, JobSpec
from hvdlite.runner.agent.state_machine import Agent
from hvdlite.runner.agent.wedged import WedgeWatch
from hvdlite.runner.hosts import HostSlots, SlotId, is_local, resolve
from hvdlite.runner.hosts.fixed import FixedHosts
from hvdlite.runner.hosts.script import ScriptHosts
from hvdlite.runner.hosts.source import HostSource
from hvdlite.runner.processes.rank_output import OutputSink
from hvdlite.runner.processes.workers import StopSignals
from hvdlite.runner.slurm import allocation as slurm_hosts
from hvdlite.runner.slurm.srun_tasks import task_opener
from hvdlite.runner.starters.auto import AutoStarter
from hvdlite.runner.starters.base import Starter
from hvdlite.runner.starters.local import LocalStarter
from hvdlite.runner.starters.mpiexec import MpiexecStarter
from hvdlite.runner.starters.ssh_tasks import TaskStarter
from hvdlite.runner.store import metrics_server
from hvdlite.runner.store.exit_reports import report_from_failure
from hvdlite.runner.store.liveness import Liveness
from hvdlite.runner.store.metrics_inbox import MetricsInbox
from hvdlite.runner.store.stack_collection import (
    OUTSIDE_TIMEOUT_S,
    Outside,
    StackReports,
    on_sigusr1,
    outside_stack_lines,
    to_stderr,
)
from hvdlite.runner.store.torch_store import TorchStore
from hvdlite.runner.tasks.ssh import SSHOptions

log = logging.getLogger(__name__)


@dataclasses.dataclass
class JobContext:
    """What every part of one job shares: its spec, identity, store and reports.  A
    platform's starter factory gets it (``JobSpec.starter``)."""

    spec: JobSpec
    key: bytes = dataclasses.field(default_factory=new_key)
    job_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    rounds: Optional[Rounds] = None
    agent: Optional[Agent] = None
    #: the ranks' stack reports (a stall, or --dump-stacks / SIGUSR1)
    stacks: StackReports = dataclasses.field(default_factory=StackReports)
    #: --mpi: the ranks' metrics and straggler lines (elsewhere the rendezvous store's)
    reports_inbox: MetricsInbox = dataclasses.field(
        default_factory=lambda: MetricsInbox(lambda rank: None)
    )
    #: torch's store for the ranks' init_process_group() (None: no torchrun variables)
    torch_store: Optional[TorchStore] = None
    #: each rank's beats and rank 0's stall verdicts, as the store sees them
    liveness: Liveness = dataclasses.field(default_factory=Liveness)

    def inbox(self) -> Optional[MetricsInbox]:
        """Where the ranks' metrics snapshots arrive: the rendezvous store's inbox, or (no
        store, ``--mpi``) the report store's."""
        service = self.rounds.service if self.rounds is not None else None
        return service.inbox if service is not None else self.reports_inbox

    def wake(self) -> None:
        if self.agent is not None:
            self.agent.wake()

    def finishing(self) -> bool:
        """Has training finished (a worker of the newest round exited 0), or the job ended?
        A platform that keeps workers coming (Spark's elastic tasks) stops then."""
        return self.agent is not None and self.agent.finishing()

    def job_env(self, local: bool, with_key: bool = False) -> Dict[str, str]:
        """What every rank of this Gloo job shares (``rank_env.shared_env``)."""
        return rank_env.shared_env(
            self.spec,
            self.rounds.address,
            self.job_id,
            self.key,
            None if self.torch_store is None else self.torch_store.port,
            local,
            with_key,
        )


def run_job(spec: JobSpec) -> JobResult:
    """Run the job ``spec`` describes to its end; prints why it failed, if it did.

    Raises:
        HvdliteConfigError: a size above --max-workers, a host name that does not
            resolve, or no mpiexec for --mpi.
        HvdliteLaunchError: a static job's hosts or workers could not be started (after
            everything that did start was ended).
    """
    spec.within_ceiling()
    source = spec.host_source or host_source(spec)
    given = {
        name: value
        for name, value in (("key", spec.key), ("job_id", spec.job_id))
        if value is not None
    }
    job = JobContext(spec, **given)
    sink = OutputSink(
        output_dir=spec.output_dir,
        timestamp=spec.timestamp_output,
        merge_ranks=spec.np if _merges_output(spec) else None,
    )
    if _wants_torch_env(spec):
        job.torch_store = TorchStore(loopback=all(is_local(h.hostname) for h in spec.hosts))
    try:
        starter = spec.starter(job) if spec.starter is not None else make_starter(job, source, sink)
        return _run_agent(job, source, starter, sink)
    finally:
        if job.torch_store is not None:
            job.torch_store.stop()
        sink.close()


def _merges_output(spec: JobSpec) -> bool:
    """Are every rank's identical stderr lines printed once?  In a static job of processes
    the launcher starts (its ranks keep their numbers), unless ``--no-merge-rank-output``;
    under ``--mpi`` each rank's wrapper tags its own lines."""
    return bool(
        spec.tunables.merge_rank_output
        and spec.controller != "mpi"
        and spec.settings.static
        and spec.starter is None
        and spec.np > 1
    )


def _wants_torch_env(spec: JobSpec) -> bool:
    """Do the ranks get torchrun's variables?  In a static Gloo job of processes the
    launcher starts, unless ``--no-torch-env``.  (An elastic job renumbers its ranks;
    MPI's ranks are mpiexec's; Ray's and Spark's workers are function calls.)"""
    return bool(
        spec.tunables.torch_env
        and spec.controller == "gloo"
        and spec.settings.static
        and spec.starter is None
    )


def _run_agent(
    job: JobContext, source: HostSource, starter: Starter, sink: OutputSink
) -> JobResult:
    """The agent's loop over ``source`` and ``starter``, with SIGINT/SIGTERM as a stop
    request, SIGUSR1 as a stack request and the metrics endpoint, then the result."""
    spec = job.spec
    address = (
        (lambda: spec.store_address) if spec.store_address else (lambda: starter.rendezvous_addr)
    )
    job.rounds = Rounds(
        job.key,
        address,
        repeat_last=spec.settings.static,
        needed=starter.needs_rendezvous,
        job_id=job.job_id,
        extra_ops=job.liveness.wrap(job.stacks.ops()),
        extra_reports=lambda: {**_output_reports(job, sink), **_starter_reports(starter)},
        port=spec.store_port,
    )
    wedges = (
        WedgeWatch(
            job.liveness,
            outside=starter.outside_stacks,
            stack_lines=outside_stack_lines,
            op_timeout_s=spec.tunables.op_timeout_s,
            write=to_stderr,
        )
        if starter.needs_rendezvous
        else None
    )
    job.agent = Agent(
        spec.settings,
        _damped(spec, source),
        starter,
        job.rounds,
        op_timeout_s=spec.tunables.op_timeout_s,
        wedges=wedges,
        elastic_timeout_s=spec.tunables.elastic_timeout_s,
    )
    _take_outside_stacks(job, starter)
    metrics = None
    try:
        metrics = _serve_metrics(job)
        with (
            StopSignals(job.agent.request_stop, action=starter.stop_action),
            on_sigusr1(job.stacks),
        ):
            code = job.agent.run()
    finally:
        if metrics is not None:
            metrics.stop()
        starter.close()
        job.rounds.shutdown()
        job.stacks.close()
    if job.agent.launch_error is not None:
        raise job.agent.launch_error
    sink.flush_pending()  # the ranks' last lines come before the verdict
    result = _result(job, starter, code)
    _say_why(job, result)
    return result


def _take_outside_stacks(job: JobContext, starter: Starter) -> None:
    """Let the stack reports take stacks from outside the ranks' processes (py-spy, through
    ``starter``), for ranks that cannot answer; a stack's rank is its slot's place in the
    newest round (a worker outside it has none)."""

    def taken(ids: List[SlotId], members: List[SlotId]) -> List[Outside]:
        got = starter.outside_stacks(ids, OUTSIDE_TIMEOUT_S) if ids else {}
        return [
            (sid, members.index(sid) if sid in members else None, stack)
            for sid, stack in got.items()
        ]

    def members() -> List[SlotId]:
        return list(job.agent.round_ids) if job.agent is not None else []

    def every() -> List[Outside]:
        ids = members()
        return taken(ids, ids)

    def for_ranks(ranks: List[int]) -> List[Outside]:
        ids = members()
        return taken([ids[r] for r in ranks if 0 <= r < len(ids)], ids)

    job.stacks.use_outside(every, for_ranks)


def _damped(spec: JobSpec, source: HostSource) -> HostSource:
    """The agent's view of a ``--host-discovery-script``: a host that appears or comes
    back is used once listed for ``--discovery-settle-seconds`` (``settling``).  Made
    here, after the starter's own look at the hosts, so that the agent's first answer is
    the one taken as is; a platform's source is used as it answers."""
    if spec.host_source is not None or not spec.discovery_script:
        return source
    return settled(source, spec.tunables.discovery_settle_s)


def _starter_reports(starter: Starter) -> Dict[SlotId, dict]:
    """The failures a platform's starter saw (a call's traceback), as exit reports."""
    return {
        sid: report_from_failure(sid, why, order)
        for order, (sid, why) in enumerate(starter.failures().items())
    }


def _output_reports(job: JobContext, sink: OutputSink) -> Dict[SlotId, dict]:
    """The exceptions ranks printed (a rank that died before ``init()``, or of a program
    that does not use hvdlite) as exit reports; a rank's own report overrides them.  Only
    in a static job, whose output prefix is each worker's rank for good."""
    if not job.spec.settings.static or job.agent is None:
        return {}
    ids = job.agent.round_ids
    return {
        ids[rank]: report_from_failure(ids[rank], line, at)
        for rank, (line, at) in sink.raised().items()
        if 0 <= rank < len(ids)
    }


def _result(job: JobContext, starter: Starter, code: int) -> JobResult:
    agent = job.agent
    ranks = list(agent.round_ids)
    returned = starter.results()
    return JobResult(
        state=agent.state.name.lower(),
        exit_code=code,
        ranks=ranks,
        results=[returned.get(sid) for sid in ranks],
        failures=dict(starter.failures()),
        summary=agent.summary or "",
        error=agent.error,
    )


def _say_why(job: JobContext, result: JobResult) -> None:
    """A failed job's flight-recorder note and summary (or the agent's error) on stderr."""
    # before the verdict, which stays the last line; a platform's workers (Ray's actors,
    # Spark's tasks, an srun step's ranks) are not processes whose dumps the note can find
    if result.exit_code not in (0, 130) and job.spec.starter is None:
        sys.stderr.write(flight_note(job))
    if result.summary:
        sys.stderr.write(result.summary)
    elif result.error:
        sys.stderr.write(f"{job.spec.name}: error: {result.error}\n")
    sys.stderr.flush()


def _serve_metrics(job: JobContext):
    """The ``--metrics-port`` endpoint (``hvdlite.runner.store.metrics_server``), or None."""
    address = metrics_server.endpoint(job.spec.tunables)
    return None if address is None else metrics_server.serve(address, job)


def host_source(spec: JobSpec) -> HostSource:
    """The discovery script, or the fixed host list (a static job's: the slots its ranks
    use, as the spec placed them).

    Raises:
        HvdliteConfigError: a listed host name does not resolve.
    """
    if spec.discovery_script:
        return ScriptHosts(
            spec.discovery_script, spec.slots_per_host, max_slots=spec.tunables.max_workers
        )
    for h in spec.hosts:
        if not is_local(h.hostname):
            resolve(h.hostname)  # "unknown host" before anything starts
    return FixedHosts(spec.hosts)


def make_starter(job: JobContext, source: HostSource, sink: OutputSink) -> Starter:
    """mpiexec for ``--mpi``; else local processes or task services (:class:`AutoStarter`),
    the tasks started through ``srun`` when every remote host is a node of the Slurm
    allocation we run in, else over SSH."""
    spec = job.spec
    if spec.controller == "mpi":
        return _mpiexec_starter(job, source.find())
    remote = [h.hostname for h in source.find() if not is_local(h.hostname)]
    via_srun = bool(remote) and not spec.discovery_script and slurm_hosts.srun_reaches(remote)
    if via_srun:
        log.info(
            "remote hosts %s are nodes of this Slurm allocation: tasks start through srun, not SSH",
            ", ".join(remote),
        )
    ssh = SSHOptions(
        port=spec.ssh_port,
        identity_file=spec.ssh_identity_file,
        known_hosts_file=spec.ssh_known_hosts_file,
        strict_host_key_checking=spec.ssh_strict_host_key_checking,
        launcher_agent=spec.launcher_agent,
    )
    return AutoStarter(
        make_local=lambda: LocalStarter(
            spec.command,
            lambda: job.job_env(local=True),
            sink,
            base_env=dict(os.environ),
            on_exit=job.wake,
        ),
        make_tasks=lambda: TaskStarter(
            job.key,
            job.job_id,
            spec.command,
            lambda: job.job_env(local=False),
            rank_env.forward_env(spec),
            ssh,
            spec.start_timeout_s,
            sink,
            network_interfaces=spec.network_interfaces,
            on_exit=job.wake,
            verbose=spec.verbose,
            open_task=task_opener() if via_srun else None,
            ranks_heard=job.liveness.heard_from_host,
        ),
        tasks_from_start=bool(remote),
    )


def _mpiexec_starter(job: JobContext, hosts: List[HostSlots]) -> MpiexecStarter:
    """One mpiexec for the job, its environment from ``rank_env.mpiexec_env``."""
    spec = job.spec
    on_line, names, hidden = rank_env.mpiexec_env(spec, job.job_id, job.key)
    return MpiexecStarter(
        hosts,
        spec.command,
        on_line,
        names,
        spec.mpi_args,
        ssh_port=spec.ssh_port if spec.ssh_port != 22 else None,
        identity_file=spec.ssh_identity_file,
        verbose=spec.verbose,
        output_dir=spec.output_dir,
        timestamp=spec.timestamp_output,
        binding_args=spec.binding_args,
        hidden_env=hidden,
        on_exit=job.wake,
        reports=(job.key, {**job.stacks.ops(), **job.reports_inbox.ops()}),
    )


def flight_note(job: JobContext) -> str:
    """Where the ranks' flight-recorder dumps are ("" when the recorder is off, or when no
    rank ever ran hvdlite's runtime, which is what writes them)."""
    spec = job.spec
    if spec.tunables.flight_recorder_size == 0 or not job.liveness.heard_any():
        return ""
    hosts = spec.hosts or ([] if spec.discovery_script else [None])
    local_only = all(h is None or is_local(h.hostname) for h in hosts)
    return flight_recorder.launcher_note(
        job.job_id, spec.tunables.flight_recorder_dir, local_only=local_only and bool(hosts)
    )
