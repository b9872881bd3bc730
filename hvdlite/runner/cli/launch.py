"""``hvdlite-run``: parse the command line (and --config-file) into one JobSpec, run it.

Kept to parse -> JobSpec -> ``run_job``: the flags (horovodrun's included) are
defined in ``flags``, the YAML file is read by ``config_file``, and every job --
static or elastic, local, SSH or MPI -- runs through
``hvdlite.runner.agent.job.run_job``.
"""

import argparse
import dataclasses
import importlib.util
import logging
import os
import shlex
import shutil
import sys
from typing import Dict, List, Optional, Tuple

from hvdlite.common import config as cfg
from hvdlite.common.config import tunables
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteError
from hvdlite.runner.cli import flags, interpreter
from hvdlite.runner.cli import validation
from hvdlite.runner.agent.job import run_job
from hvdlite.runner.agent.settings import FLAGS, JobSettings, check_sizes, validate
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.cli.config_file import config_file_defaults
from hvdlite.runner.cli.options import LaunchOptions
from hvdlite.runner.hosts import (
    HostSlots,
    assign_slots,
    hosts_used,
    is_local,
    parse_hostfile,
    parse_hosts,
)
from hvdlite.runner.hosts.cluster_env import hosts_from_environment
from hvdlite.runner.slurm import allocation as slurm_hosts
from hvdlite.runner.store.stack_collection import signal_launcher
from hvdlite.runner.starters.mpiexec import find_mpiexec
from hvdlite.runner.tasks import host_check
from hvdlite.runner.tasks.ssh import SSHOptions
from hvdlite.version import __version__

log = logging.getLogger("hvdlite.runner")


def parse_args(argv: Optional[List[str]] = None) -> LaunchOptions:
    """Parse the flags; --config-file's values become defaults that the flags override."""
    args = flags.shared_parser().parse_args(argv)
    if not args.config_file:
        return LaunchOptions.from_namespace(args)
    given = args.gloo or args.mpi or args.jsrun
    keys: Dict[str, str] = {}
    parser = flags.build_parser()  # the file's values become its defaults
    parser.set_defaults(**config_file_defaults(parser, args.config_file, given, keys))
    cli = args
    # the file's key for each value the command line did not give (for messages)
    return LaunchOptions.from_namespace(
        parser.parse_args(argv),
        {d: k for d, k in keys.items() if getattr(cli, d, None) in (None, False)},
    )


def _resolve_command(command: List[str]) -> List[str]:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise HvdliteConfigError(
            "no training command given (e.g. hvdlite-run -np 2 python train.py)"
        )
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    exe = command[0]
    if shutil.which(exe) is None and not os.path.exists(exe):
        raise HvdliteConfigError(f"command {exe!r} not found")
    if exe == sys.executable or os.path.basename(exe).startswith("python"):
        script = next((a for a in command[1:] if not a.startswith("-")), None)
        if script and script.endswith(".py") and not os.path.exists(script):
            raise HvdliteConfigError(f"training script {script!r} not found")
    return command


def _check_interpreter(command: List[str], hosts, allow: bool) -> None:
    """Refuse a command whose Python lacks what the launcher's has (the ranks would all die
    of "No module named ..."), unless told to go on; a job on remote hosts only, whose
    Python is not this host's, gets the warning alone."""
    warning = interpreter.mismatch(command)
    if not warning:
        return
    here = not hosts or any(is_local(h.hostname) for h in hosts)
    if allow or not here:
        log.warning("%s", warning)
        return
    variable = tunables.BY_FIELD["allow_other_interpreter"].env
    raise HvdliteConfigError(
        f"{warning}. Nothing was started; to start it anyway (a program that needs neither), "
        f"add --allow-other-interpreter ({variable}=1)"
    )


def _user_env(items: Optional[List[str]]) -> Dict[str, str]:
    env = {}
    for item in items or []:
        name, sep, value = str(item).partition("=")
        if not name or not name.replace("_", "a").isalnum():
            raise HvdliteConfigError(f"-x {item!r}: not a variable name")
        if not sep:
            if name not in os.environ:
                log.warning("-x %s: not set in this environment; not passed", name)
                continue
            value = os.environ[name]
        env[name] = value
    return env


#: the frameworks hvdlite has an adapter for: the name --check-build shows -> its module
FRAMEWORKS = {"TensorFlow": "tensorflow", "PyTorch": "torch"}


def frameworks_available() -> Dict[str, bool]:
    """Each framework hvdlite adapts -> whether it is installed (found, not imported:
    importing TensorFlow takes seconds)."""
    return {
        name: importlib.util.find_spec(module) is not None for name, module in FRAMEWORKS.items()
    }


def controllers_available() -> Dict[str, bool]:
    has_torch = importlib.util.find_spec("torch") is not None
    return {
        "gloo": has_torch,
        "mpi": find_mpiexec() is not None and importlib.util.find_spec("mpi4py") is not None,
    }


def check_build() -> str:
    """What ``--check-build`` prints: each framework hvdlite adapts, each controller and
    each tensor operation's library, marked [X] where it is available here (Horovod's
    layout; its GPU libraries are listed unmarked, as hvdlite runs on CPU tensors only)."""
    ctl = controllers_available()

    def box(x):
        return "[X]" if x else "[ ]"

    lines = [f"hvdlite v{__version__}:", "", "Available Frameworks:"]
    lines += [f"    {box(ok)} {name}" for name, ok in frameworks_available().items()]
    lines += [
        "",
        "Available Controllers:",
        f"    {box(ctl['gloo'])} Gloo",
        f"    {box(ctl['mpi'])} MPI",
        "",
    ]
    lines += [
        "Available Tensor Operations:",
        "    [ ] NCCL",
        "    [ ] DDL",
        "    [ ] CCL",
        f"    {box(ctl['mpi'])} MPI",
        f"    {box(ctl['gloo'])} Gloo",
        "    (CPU tensors only: no CUDA tensors, no NCCL)",
        "",
    ]
    return "\n".join(lines)


def spec_from_args(args: LaunchOptions) -> JobSpec:
    """Validate the flags into the job's spec.

    Raises:
        HvdliteConfigError: any bad flag value, host list or command, or a flag for a
            feature hvdlite does not offer (names the flag and why).
    """
    args = dataclasses.replace(args)  # -np is settled below: not in the caller's
    elastic = _is_elastic(args)
    allocation, np = _check_size_and_combinations(args, elastic)
    parser = flags.shared_parser()
    validation.check_finite_numbers(args, parser)
    flag_env = _tunable_env(args)
    flag_env[cfg.CPU_OPERATIONS] = _controller(args, elastic)
    user_env = _user_env(args.env)
    # -x HVDLITE_...=... reaches the ranks too: the one Config sees what they will see;
    # the spec stores only this config (the ranks' variables are derived from it)
    config = validation.check_tunables(
        args, parser, flags.TUNABLE_FLAGS, flag_env, environ={**os.environ, **user_env}
    )
    # before any host list is built or slot placed: -np 10**20 must not be looped over
    _check_ceiling(args, config.max_workers, parser)
    elastic_settings = _elastic_settings(args, np, elastic)
    command = _resolve_command(list(args.command))
    hosts = _hosts(args, np, allocation, static=not elastic)
    _check_interpreter(command, hosts, config.allow_other_interpreter)
    _check_ssh(args)
    nics = None
    if args.network_interfaces:
        nics = [n.strip() for n in args.network_interfaces.split(",") if n.strip()]
    return JobSpec(
        np=np,
        hosts=hosts,
        command=command,
        tunables=config,
        verbose=args.verbose,
        output_dir=args.output_filename,
        timestamp_output=args.prefix_output_with_timestamp,
        ssh_port=args.ssh_port or 22,
        ssh_identity_file=args.ssh_identity_file,
        ssh_known_hosts_file=args.ssh_known_hosts,
        ssh_strict_host_key_checking=args.ssh_strict_host_key_checking,
        launcher_agent=args.launcher_agent,
        network_interfaces=nics,
        mpi_args=shlex.split(args.mpi_args or ""),
        binding_args=shlex.split(args.binding_args) if args.binding_args else None,
        user_env=user_env,
        elastic=elastic_settings,
        discovery_script=args.host_discovery_script,
        slots_per_host=args.slots_per_host or 1,
    ).within_ceiling()


def _check_size_and_combinations(
    args: LaunchOptions, elastic: bool
) -> Tuple[Optional[List[HostSlots]], int]:
    """Refuse what hvdlite does not offer and flags that exclude each other; settle -np
    (from --min-np, or a Slurm allocation's tasks).  Returns the allocation's hosts, if
    they are the job's, and -np.

    Raises:
        HvdliteConfigError: names the flag and why.
    """
    refused = flags.refusal(args)
    if refused:
        raise HvdliteConfigError(refused)
    allocation = _slurm_defaults(args)
    if args.np is None and elastic and args.min_np is not None:
        args.np = args.min_np
    if args.np is None:
        raise HvdliteConfigError(
            "-np is required (the number of processes)" + (" or --min-np" if elastic else "")
        )
    if args.binding_args and not args.mpi:
        raise HvdliteConfigError(
            "--binding-args: it is passed to mpiexec, so it needs --mpi (in Gloo mode "
            "hvdlite-run starts the ranks itself and does not bind them)"
        )
    if args.launcher_agent and args.mpi:
        raise HvdliteConfigError(
            "--launcher-agent: with --mpi, mpiexec starts the remote ranks itself; give its "
            "own option instead (MPICH: --mpi-args '-launcher-exec CMD')"
        )
    return allocation, args.np


def _check_ceiling(args: LaunchOptions, ceiling: int, parser: argparse.ArgumentParser) -> None:
    """-np >= 1, and -np, --min-np and --max-np at most --max-workers (``check_sizes``),
    before the hosts are parsed or slots placed; a size from --config-file is named as
    its key there.

    Raises:
        HvdliteConfigError: names the flag, its value and the ceiling (and how to raise it).
    """
    sizes = ("np", "min_np", "max_np")
    names = dataclasses.replace(
        FLAGS,
        **{
            dest: validation.setting_name(args, parser, dest)
            for dest in sizes
            if dest in args.config_file_keys
        },
    )
    check_sizes(*(args.value(dest) for dest in sizes), ceiling=ceiling, names=names)


def _slurm_defaults(args: LaunchOptions) -> Optional[List[HostSlots]]:
    """Inside a Slurm allocation, with neither -H nor --hostfile (nor a discovery script):
    the allocation's nodes and tasks are the hosts, and -np defaults to their total.

    Raises:
        HvdliteConfigError: a Slurm variable does not parse (names it).
    """
    if args.hosts or args.hostfile or args.host_discovery_script:
        return None
    hosts = slurm_hosts.allocation_hosts()
    if not hosts:
        return None
    listing = ",".join(f"{h.hostname}:{h.slots}" for h in hosts)
    total = sum(h.slots for h in hosts)
    if args.np is None and args.min_np is None:
        args.np = total
    if args.np is not None and args.np > total:
        raise HvdliteConfigError(
            f"-np {args.np} asks for more processes than the {total} tasks of the Slurm "
            f"allocation ({slurm_hosts.describe()}: {listing}); lower -np, ask Slurm for "
            f"more tasks, or give the hosts yourself with -H/--hostfile"
        )
    log.info(
        "hosts from the Slurm allocation (%s): %s; -np %s%s",
        slurm_hosts.describe(),
        listing,
        args.np,
        " (the allocation's total)" if args.np == total else "",
    )
    return hosts


def _hosts(
    args: LaunchOptions, np: int, allocation: Optional[List[HostSlots]], static: bool
) -> List[HostSlots]:
    """-H or --hostfile, else the Slurm ``allocation``, else a cluster's host list from the
    environment, else this host (none with a discovery script); checked to hold -np
    slots, and for a ``static`` job cut to the slots its ranks use (placed once, here)."""
    if args.host_discovery_script:
        return []
    found = None if (args.hostfile or args.hosts or allocation) else hosts_from_environment()
    if args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    elif allocation:
        hosts = allocation
    elif found is not None:
        hosts, where = found
        log.info("hosts from %s: %s", where, ", ".join(f"{h.hostname}:{h.slots}" for h in hosts))
    else:
        hosts = parse_hosts(args.hosts or f"localhost:{np}")
    if hosts and static:
        return hosts_used(hosts, np)  # -np > slots is an error before anything starts
    if hosts:
        assign_slots(hosts, np)
    return hosts


def _tunable_env(args: LaunchOptions) -> Dict[str, str]:
    """The HVDLITE_* variables the tunable flags given (or --config-file keys) set."""
    env = {}
    for dest, (var, conv) in flags.TUNABLE_FLAGS.items():
        value = args.value(dest)
        try:
            text = conv(value) if value is not None else None
        except OverflowError:  # 1e308 MiB in bytes is infinite
            raise HvdliteConfigError(
                f"{validation.setting_name(args, flags.shared_parser(), dest)} {value:g}: the "
                f"value must be {_range_words(var)}"
            ) from None
        if text is not None:
            env[var] = text
    return env


def _range_words(variable: str) -> str:
    """The allowed range of the tunable set through ``variable``, in words."""
    row = next(t for t in tunables.TUNABLES if t.env == variable)
    return row.range.words if row.range is not None else "a finite number"


def _controller(args: LaunchOptions, elastic: bool) -> str:
    """ "gloo" or "mpi": the flag's, else Gloo unless only MPI is available."""
    if args.mpi:
        return "mpi"
    if args.gloo or elastic:
        return "gloo"
    avail = controllers_available()
    return "mpi" if (avail["mpi"] and not avail["gloo"]) else "gloo"


def _elastic_settings(args: LaunchOptions, np: int, elastic: bool) -> Optional[JobSettings]:
    """The elastic flags checked (None for a static job, which must not use them).

    Raises:
        HvdliteConfigError: an elastic-only flag in a static job, or a bad elastic value.
    """
    if not elastic:
        for dest, flag in _ELASTIC_ONLY.items():
            if args.value(dest) is not None:
                raise HvdliteConfigError(
                    f"{flag} applies to elastic jobs only; add --min-np, --max-np or "
                    f"--host-discovery-script, or drop it"
                )
        return None
    return validate(
        np=np,
        min_np=args.min_np,
        max_np=args.max_np,
        reset_limit=args.reset_limit,
        cooldown_range=args.blacklist_cooldown_range,
        slots_per_host=args.slots_per_host,
        discovery_script=args.host_discovery_script,
        fixed_hosts=bool(args.hosts or args.hostfile),
        mpi=args.mpi,
    )


def _check_ssh(args: LaunchOptions) -> None:
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise HvdliteConfigError(f"-p/--ssh-port {args.ssh_port}: not a port number")
    if args.ssh_identity_file and not os.path.isfile(args.ssh_identity_file):
        raise HvdliteConfigError(f"-i/--ssh-identity-file {args.ssh_identity_file}: no such file")


def _is_elastic(args: LaunchOptions) -> bool:
    return any(args.value(f) is not None for f in ("min_np", "max_np", "host_discovery_script"))


#: flags that mean something only in an elastic job
_ELASTIC_ONLY = {
    "slots_per_host": "--slots-per-host",
    "elastic_timeout": "--elastic-timeout",
    "reset_limit": "--reset-limit",
    "blacklist_cooldown_range": "--blacklist-cooldown-range",
}


def _check_hosts(args: LaunchOptions) -> int:
    """``--check-hosts``: the hosts of -H/--hostfile, checked for what a job needs.

    Raises:
        HvdliteConfigError: no hosts given, or a flag of theirs is bad.
    """
    if not (args.hosts or args.hostfile):
        raise HvdliteConfigError("--check-hosts: give the hosts to check with -H or --hostfile")
    if args.launcher_agent:
        raise HvdliteConfigError(
            "--check-hosts checks SSH hosts; with --launcher-agent, run the agent's own check"
        )
    _check_ssh(args)
    hosts = parse_hostfile(args.hostfile) if args.hostfile else parse_hosts(args.hosts or "")
    opts = SSHOptions(
        port=args.ssh_port or 22,
        identity_file=args.ssh_identity_file,
        known_hosts_file=args.ssh_known_hosts,
        strict_host_key_checking=args.ssh_strict_host_key_checking,
    )
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    return host_check.main(hosts, opts, command)


def main(argv: Optional[List[str]] = None) -> int:
    """hvdlite-run's entry point; returns the exit code (2 for a refused command line)."""
    logging.basicConfig(level=logging.WARNING, format="hvdlite-run: %(message)s")
    try:
        args = parse_args(argv)
        if args.version:
            print(f"hvdlite-run {__version__}")
            return 0
        if args.check_build:
            print(check_build())
            return 0
        if args.check_hosts:
            return _check_hosts(args)
        if args.dump_stacks is not None:
            print(signal_launcher(args.dump_stacks))
            return 0
        if args.value("log_level"):
            logging.getLogger("hvdlite").setLevel(cfg.log_level_name(args.value("log_level")))
        elif args.verbose:
            logging.getLogger("hvdlite").setLevel(logging.INFO)
        return run_job(spec_from_args(args)).exit_code
    except HvdliteError as exc:
        sys.stderr.write(f"hvdlite-run: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
