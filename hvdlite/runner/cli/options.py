"""One launch's options, typed: what the command line gives and what ``hvdlite.run`` passes.

``hvdlite-run`` parses its flags (and ``--config-file``) into
:class:`LaunchOptions`; ``hvdlite.run`` builds one from its arguments without making
or parsing a command line.  Either way ``launch.spec_from_args`` checks it once into
the job's ``JobSpec``.  The launcher's own flags are fields here; the table's tunable
flags (``--fusion-threshold-mb``, ``--op-timeout-seconds``, ...) are kept by flag
name in :attr:`LaunchOptions.tunable_values`, since the table (``common.config.tunables``)
is their one definition.  A test keeps the fields and the parser's flags the same.
"""

import argparse
import dataclasses
from typing import Any, Dict, List, Optional

from hvdlite.runner.cli import flags


@dataclasses.dataclass
class LaunchOptions:
    """Every hvdlite-run flag that is not a tunable, at the parser's defaults (``None``:
    not given), the tunable flags given, and the training command."""

    np: Optional[int] = None
    version: bool = False
    check_build: bool = False
    check_hosts: bool = False
    config_file: Optional[str] = None
    verbose: bool = False
    dump_stacks: Optional[int] = None
    disable_cache: bool = False
    hosts: Optional[str] = None
    hostfile: Optional[str] = None
    #: comma-separated, as --network-interfaces takes them
    network_interfaces: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    ssh_known_hosts: Optional[str] = None
    ssh_strict_host_key_checking: bool = False
    launcher_agent: Optional[str] = None
    gloo: bool = False
    mpi: bool = False
    jsrun: bool = False
    #: one string, split like a shell would
    mpi_args: Optional[str] = None
    binding_args: Optional[str] = None
    tcp: bool = False
    mpi_threads_disable: Optional[bool] = None
    num_nccl_streams: Optional[int] = None
    thread_affinity: Optional[int] = None
    #: -x items: NAME=VALUE, or NAME to pass on this environment's value
    env: Optional[List[str]] = None
    output_filename: Optional[str] = None
    prefix_output_with_timestamp: bool = False
    log_with_timestamp: Optional[bool] = None
    torus_allreduce: Optional[bool] = None
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    slots_per_host: Optional[int] = None
    host_discovery_script: Optional[str] = None
    reset_limit: Optional[int] = None
    blacklist_cooldown_range: Optional[List[float]] = None
    command: List[str] = dataclasses.field(default_factory=list)
    #: the tunable flags given, by argparse dest (``fusion_threshold_mb``): their values as
    #: parsed, before the table converts them to the ranks' variables
    tunable_values: Dict[str, Any] = dataclasses.field(default_factory=dict)
    #: for each value that came from --config-file, not the command line: its key there
    #: (so that a message names what the user wrote)
    config_file_keys: Dict[str, str] = dataclasses.field(default_factory=dict)

    def value(self, dest: str) -> Any:
        """The value of the flag whose argparse dest is ``dest`` (None: not given)."""
        if dest in flags.TUNABLE_FLAGS:
            return self.tunable_values.get(dest)
        return getattr(self, dest)

    @classmethod
    def from_namespace(
        cls, parsed: argparse.Namespace, config_file_keys: Optional[Dict[str, str]] = None
    ) -> "LaunchOptions":
        """The options argparse parsed (a dest this class lacks is a bug: ``TypeError``)."""
        given = dict(vars(parsed))
        tunable_values = {dest: given.pop(dest) for dest in flags.TUNABLE_FLAGS if dest in given}
        given["command"] = list(given.get("command") or [])
        return cls(
            **given,
            config_file_keys=dict(config_file_keys or {}),
            tunable_values={d: v for d, v in tunable_values.items() if v is not None},
        )
