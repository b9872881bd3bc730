"""One launch's configuration, whole: :class:`LaunchConfig`.

``hvdlite-run`` builds it from the flags (``launch.settings_from_args``),
``hvdlite.run`` from its arguments; it travels whole into the agent
(``hvdlite.runner.agent.run_job``), which picks the host source and the starter
from it and builds every rank's environment from it in one place.
"""

import dataclasses
import os
from typing import Dict, List, Optional

from hvdlite.common import config as cfg
from hvdlite.runner.agent.settings import JobSettings
from hvdlite.runner.hosts import HostSlots

#: variables every host's workers get from the launcher's environment (besides -x ones)
FORWARD_ALWAYS = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
#: per-job HVDLITE_* names the launcher sets itself; never forwarded from its own environment
_JOB_NAMES = {cfg.RANK, cfg.SIZE, cfg.LOCAL_RANK, cfg.LOCAL_SIZE, cfg.CROSS_RANK,
              cfg.CROSS_SIZE, cfg.HOSTNAME, cfg.RENDEZVOUS_ADDR, cfg.RENDEZVOUS_PORT,
              cfg.SECRET_KEY, cfg.JOB_ID, cfg.GLOO_IFACE, cfg.ELASTIC, cfg.ELASTIC_TIMEOUT,
              cfg.RUN_FUNC_KEY, cfg.RUN_FUNC_PORT, cfg.RUN_FUNC_ADDRS}
_HOROVOD_IDENTITY = set(cfg.HOROVOD_ALIASES.values())


@dataclasses.dataclass
class LaunchConfig:
    """Everything one launch needs, derived from flags (and --config-file)."""

    np: int
    hosts: List[HostSlots]
    command: List[str]
    controller: str = "gloo"                      # "gloo" or "mpi"
    verbose: bool = False
    output_dir: Optional[str] = None
    timestamp_output: bool = False
    start_timeout_s: float = cfg.Config.start_timeout_s
    ssh_port: int = 22
    ssh_identity_file: Optional[str] = None
    ssh_known_hosts_file: Optional[str] = None
    ssh_strict_host_key_checking: bool = False
    launcher_agent: Optional[str] = None       # --launcher-agent (None: SSH)
    network_interfaces: Optional[List[str]] = None
    mpi_args: List[str] = dataclasses.field(default_factory=list)
    #: --binding-args (--mpi only): replaces mpiexec's default binding flags
    binding_args: Optional[List[str]] = None
    #: HVDLITE_* tunables from flags
    tunable_env: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: -x NAME=VALUE (and -x NAME resolved from our environment)
    user_env: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: the elastic flags; None for a static job
    elastic: Optional[JobSettings] = None
    #: --host-discovery-script (elastic jobs; None: the host list is fixed)
    discovery_script: Optional[str] = None
    #: --slots-per-host: slots of a discovered host printed without ``:N``
    slots_per_host: int = 1
    #: --max-workers: a discovered host with more slots than this is a failed discovery
    max_workers: int = cfg.Config.max_workers
    #: variables every rank gets that must never appear on a command line (hvdlite.run's
    #: service key): in the workers' environment, in the tasks' stdin payload, or passed
    #: by name to mpiexec
    secret_env: Dict[str, str] = dataclasses.field(default_factory=dict)

    def forward_env(self) -> Dict[str, str]:
        """The allow-list remote hosts get: the user's HVDLITE_* and HOROVOD_* variables,
        PATH & co, -x names, the tunables and the secret variables."""
        env = {k: v for k, v in os.environ.items() if forwarded(k)}
        env.update(self.user_env)
        env.update(self.tunable_env)
        env.update(self.secret_env)
        return env


def forwarded(name: str) -> bool:
    """Whether the launcher's variable ``name`` travels to every host's workers."""
    if name in FORWARD_ALWAYS:
        return True
    if name.startswith(cfg.PREFIX):
        return name not in _JOB_NAMES
    # the identity aliases are set per rank by the launcher, never taken from its own env
    return name.startswith(cfg.HOROVOD_PREFIX) and name not in _HOROVOD_IDENTITY


#: the name launch.py and hvdlite.run have always used; the same class
Settings = LaunchConfig
