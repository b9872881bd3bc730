"""What goes into a job and what comes out: :class:`JobSpec` and :class:`JobResult`.

Every place a job starts builds one :class:`JobSpec` -- ``hvdlite-run`` from its flags
(``hvdlite.runner.cli.launch``), ``hvdlite.run`` from its Python arguments, Ray and
Spark from their executors' arguments -- and hands it to
:func:`hvdlite.runner.agent.job.run_job`, which returns one :class:`JobResult`.  A
platform that places its workers itself (Ray actors, Spark tasks) gives its own host
source and a starter factory; the job's key, id, store, environment, stop signals and
failure summary are ``run_job``'s alone.
"""

import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional

from hvdlite.common import config as cfg
from hvdlite.runner.agent.settings import FLAGS, JobSettings, SizeNames, check_sizes
from hvdlite.runner.hosts import HostSlots, SlotId
from hvdlite.runner.hosts.source import HostSource
from hvdlite.runner.starters.base import Starter


@dataclasses.dataclass
class JobSpec:
    """Everything one job needs: its size, hosts, command (or a platform's starter), the
    validated tunables and the variables its ranks get."""

    np: int
    hosts: List[HostSlots]
    command: List[str]
    #: the tunables, validated once (flags, --config-file, the launcher's environment):
    #: the one place the job's settings are stored; the launcher reads them from here,
    #: the ranks get them through :meth:`tunable_env`
    #: (default: what this process's environment sets, on Gloo: a platform's job)
    tunables: cfg.Config = dataclasses.field(default_factory=lambda: _platform_tunables())
    verbose: bool = False
    output_dir: Optional[str] = None
    timestamp_output: bool = False
    ssh_port: int = 22
    ssh_identity_file: Optional[str] = None
    ssh_known_hosts_file: Optional[str] = None
    ssh_strict_host_key_checking: bool = False
    launcher_agent: Optional[str] = None  # --launcher-agent (None: SSH)
    network_interfaces: Optional[List[str]] = None
    mpi_args: List[str] = dataclasses.field(default_factory=list)
    #: --binding-args (--mpi only): replaces mpiexec's default binding flags
    binding_args: Optional[List[str]] = None
    #: -x NAME=VALUE (and -x NAME resolved from our environment)
    user_env: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: the elastic flags; None for a static job
    elastic: Optional[JobSettings] = None
    #: --host-discovery-script (elastic jobs; None: the host list is fixed)
    discovery_script: Optional[str] = None
    #: --slots-per-host: slots of a discovered host printed without ``:N``
    slots_per_host: int = 1
    #: variables every rank gets that must never appear on a command line (hvdlite.run's
    #: service key): in the workers' environment, in the tasks' stdin payload, or passed
    #: by name to mpiexec
    secret_env: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: a platform's own host source (Ray's nodes, Spark's tasks); None: ``hosts`` or
    #: ``discovery_script``
    host_source: Optional[HostSource] = None
    #: a platform's starter, made by ``run_job`` once the job's key, id and store exist
    #: (``starter(job)``, ``job`` the ``hvdlite.runner.agent.job.JobContext``); None:
    #: local processes, SSH tasks or mpiexec, as the other fields say
    starter: Optional[Callable[[Any], Starter]] = None
    #: where the rendezvous store listens when a platform's starter decides (its driver's
    #: address); None: the starter's ``rendezvous_addr``
    store_address: Optional[str] = None
    #: who runs the job, for the lines it prints ("hvdlite-run", "RayExecutor.run", ...)
    name: str = "hvdlite-run"
    #: the job's key when a platform handed it to its workers before the job (Spark's
    #: tasks get it in their closure, Spark's own channel); None: ``run_job`` makes one
    key: Optional[bytes] = None
    #: the job's id when the workers already know it (a plain ``srun`` step's); None:
    #: ``run_job`` makes one
    job_id: Optional[str] = None
    #: the port the store listens on when the workers already know it (0: any free one)
    store_port: int = 0
    #: what the caller calls the job's sizes in its messages (a platform's arguments)
    size_names: SizeNames = FLAGS

    @property
    def settings(self) -> JobSettings:
        """The agent's view: the elastic flags, or a static job of ``np`` ranks."""
        return self.elastic or JobSettings.static_job(self.np)

    @property
    def controller(self) -> str:
        """ "gloo" or "mpi": the tunables' ``cpu_operations``, which the launcher settles
        (a platform's job is Gloo); the ranks get it with the other tunables."""
        return self.tunables.cpu_operations or "gloo"

    @property
    def start_timeout_s(self) -> float:
        """The bound on the workers starting and on each rank's ``init()``."""
        return self.tunables.start_timeout_s

    def with_start_timeout(self, seconds: float) -> "JobSpec":
        """This spec with ``seconds`` (> 0, checked by the caller) as the start timeout."""
        self.tunables = self.tunables.replace(start_timeout_s=float(seconds))
        return self

    def with_elastic_timeout(self, seconds: Optional[float]) -> "JobSpec":
        """This spec with ``seconds`` as the elastic timeout (None: as it is).

        Raises:
            HvdliteConfigError: not a number of seconds in the tunable's range.
        """
        if seconds is not None:
            self.tunables = self.tunables.replace(elastic_timeout_s=float(seconds))
        return self

    def within_ceiling(self) -> "JobSpec":
        """This spec, its sizes checked against ``--max-workers`` (``settings.check_sizes``)
        and an elastic job without a maximum capped there; ``run_job`` holds every spec to
        it, whoever built it.

        Raises:
            HvdliteConfigError: a size out of range, named as the caller gave it.
        """
        ceiling, elastic = self.tunables.max_workers, self.elastic
        check_sizes(
            self.np,
            elastic.min_np if elastic else None,
            elastic.max_np if elastic else None,
            ceiling=ceiling,
            names=self.size_names,
        )
        if elastic is not None and elastic.max_np is None:
            self.elastic = dataclasses.replace(elastic, max_np=ceiling)
        return self

    def tunable_env(self) -> Dict[str, str]:
        """The ``HVDLITE_*`` variables that give the ranks :attr:`tunables`, beside what
        they inherit (this process's environment and ``-x``); derived, never stored."""
        return self.tunables.tunable_env({**os.environ, **self.user_env})


def _platform_tunables() -> cfg.Config:
    """A platform's job (Ray, Spark, a plain srun step) has no flags: the tunables this
    process's environment sets, on Gloo."""
    return cfg.Config.tunables_of(os.environ).replace(cpu_operations="gloo")


@dataclasses.dataclass
class JobResult:
    """How a job ended, whatever ran it."""

    #: the agent's final state: "succeeded", "failed" or "stopped"
    state: str
    #: 0, the failure's exit status, or 130 after SIGINT/SIGTERM
    exit_code: int
    #: the last round's workers in rank order
    ranks: List[SlotId] = dataclasses.field(default_factory=list)
    #: what each of those ranks returned, in rank order (platforms whose workers return
    #: a value: Ray, Spark; None for a process)
    results: List[Any] = dataclasses.field(default_factory=list)
    #: why workers failed, by slot, in the order they failed (as the starter saw it: a
    #: traceback, an actor's death); empty for processes, whose exits the summary names
    failures: Dict[SlotId, str] = dataclasses.field(default_factory=dict)
    #: the failure summary printed for the user ("" on success): the rank that failed
    #: first, its host and its exception
    summary: str = ""
    #: why the agent failed the job (None on success)
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0
