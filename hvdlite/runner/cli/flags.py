"""hvdlite-run's command line: every flag, horovodrun's included, and what each one becomes.

Kept apart from ``launch.py`` (which turns parsed flags into a ``JobSpec`` and
dispatches) because horovodrun compatibility makes the flag list long.  Each of
horovodrun's flags is here under its own spelling and aliases, and is either
implemented, accepted because it asks for what hvdlite always does (:data:`NO_OP_FLAGS`),
or refused with the reason (:data:`REFUSED_FLAGS`); none gets argparse's bare
"unrecognized arguments".

The parser is built from data: the tunables' flags from ``common.config.tunables`` and the
others from :data:`GROUPS`; every flag's help ends with its default.
"""

import argparse
import dataclasses
import functools
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from hvdlite.common.config import tunables


#: flag dest -> (HVDLITE_* variable, parsed value -> the variable's text, None: sets nothing),
#: from the table of tunables
TUNABLE_FLAGS = tunables.flag_variables()

#: horovodrun flags for what hvdlite does not do: parsed, so that Horovod users get the
#: reason instead of argparse's "unrecognized arguments", then refused when the parsed value
#: asks for the feature (anything but unset or False).  dest -> (flag, reason)
REFUSED_FLAGS: Dict[str, Tuple[str, str]] = {
    "num_nccl_streams": (
        "--num-nccl-streams",
        "NCCL is GPU only and hvdlite is a CPU build without NCCL",
    ),
    "torus_allreduce": (
        "--torus-allreduce",
        "the torus allreduce is an NCCL algorithm (GPU only) and hvdlite is a "
        "CPU build without NCCL",
    ),
    "thread_affinity": (
        "--thread-affinity",
        "hvdlite's background loop is a Python thread and pinning it to a core is not implemented",
    ),
    "mpi_threads_disable": (
        "--mpi-threads-disable",
        "hvdlite calls MPI from its background "
        "thread, so MPI's thread support cannot be turned off",
    ),
    "log_with_timestamp": (
        "--log-with-timestamp/--no-log-hide-timestamp",
        "hvdlite's log lines carry no timestamp; use "
        "--prefix-output-with-timestamp to timestamp every output line",
    ),
    "jsrun": (
        "--jsrun",
        "jsrun (IBM LSF) is not supported; launch with Gloo (the default) or --mpi",
    ),
}

#: horovodrun flags accepted because they ask for what hvdlite always does: flag -> why
NO_OP_FLAGS: Dict[str, str] = {
    "--disable-cache": "hvdlite-run never caches its host checks; every run checks afresh",
    "--tcp": "hvdlite's own traffic (Gloo, control plane) is TCP; in --mpi mode, as with "
    "horovodrun on MPICH and Open MPI, MPI keeps its transport (see --mpi-args)",
    "--no-mpi-threads-disable": "hvdlite keeps MPI's thread support",
    "--no-torus-allreduce": "hvdlite has no torus allreduce (an NCCL algorithm)",
    "--log-without-timestamp": "hvdlite's log lines carry no timestamp",
    "--log-hide-timestamp": "hvdlite's log lines carry no timestamp",
    # --no-hierarchical-allreduce and --no-hierarchical-allgather, from the table
    **{
        name: switch.off_help
        for t in tunables.TUNABLES
        for switch in t.flags
        if isinstance(switch, tunables.Switch) and switch.off_is_default_only
        for name in switch.off
    },
}


def refusal(args: Any) -> Optional[str]:
    """The error for the first refused flag the parsed ``args`` (``LaunchOptions``) ask
    for, else None."""
    for dest, (flag, reason) in REFUSED_FLAGS.items():
        value = getattr(args, dest)
        if value is not None and value is not False:  # 0 is a value, too
            return f"{flag}: {reason}; remove the flag"
    return None


def _no_op(flag: str) -> str:
    return f"accepted for horovodrun: {NO_OP_FLAGS[flag]}"


def _refused(dest: str) -> str:
    return f"refused: {REFUSED_FLAGS[dest][1]}"


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag that is not a tunable: its spellings, argparse keywords, help, and the
    default its help shows ("" for actions such as --version)."""

    names: Tuple[str, ...]
    help: str
    default: str = ""
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OneOf:
    """Flags that exclude each other."""

    flags: Tuple[Flag, ...]


@dataclasses.dataclass(frozen=True)
class Group:
    """A section of ``--help`` (``None``: the parser's own); the tunables whose
    ``group`` is this title follow its entries."""

    title: Optional[str]
    description: Optional[str]
    entries: Tuple[Union[Flag, OneOf], ...] = ()


_SWITCH = {"action": "store_true"}
_CONTROLLER_DEFAULT = "--gloo, or --mpi where only MPI is available"

#: every flag that is not a tunable, section by section, in --help's order
GROUPS: Tuple[Group, ...] = (
    Group(
        None,
        None,
        (
            Flag(("-v", "--version"), "print the version and exit", options=_SWITCH),
            Flag(
                ("-np", "--num-proc"),
                "total number of training processes",
                "none: required, except that an elastic job takes --min-np",
                {"dest": "np", "type": int},
            ),
            Flag(
                ("-cb", "--check-build"),
                "show which frameworks and controllers are available, and exit",
                options=_SWITCH,
            ),
            Flag(
                ("--check-hosts",),
                "check each host of -H/--hostfile for what a job needs there (SSH login with a "
                "key, hvdlite-run's Python and the command's interpreter at the same paths, the "
                "working directory, TCP back to this host), print what fails with its fix, and "
                "exit (1 when something fails)",
                options=_SWITCH,
            ),
            Flag(
                ("--config-file",),
                "YAML file: horovodrun's format (params:, timeline:, autotune:, stall_check:, "
                "library_options:, logging:, controller:) and any long flag name (e.g. "
                "'fusion-threshold-mb: 32'), top level or in a section such as elastic:; flags "
                "given on the command line win",
                "none",
                {"metavar": "FILE"},
            ),
            Flag(("--verbose",), "report each launch step", "off", _SWITCH),
            Flag(
                ("--dump-stacks",),
                "ask the running hvdlite-run with this process id for every rank's Python "
                "stacks (as SIGUSR1 to it does; the report appears in that launcher's output), "
                "and exit",
                "none",
                {"metavar": "PID", "type": int},
            ),
            Flag(("--disable-cache",), _no_op("--disable-cache"), "off", _SWITCH),
        ),
    ),
    Group(
        "host arguments",
        None,
        (
            OneOf(
                (
                    Flag(
                        ("-H", "--hosts"),
                        "[user@]host:slots list, e.g. localhost:2,node2:4",
                        "localhost:NP",
                        {"metavar": "HOSTS"},
                    ),
                    Flag(
                        ("-hostfile", "--hostfile"),
                        "file with one 'host slots=N' per line (# comments allowed)",
                        "none",
                        {"metavar": "FILE"},
                    ),
                )
            ),
            Flag(
                ("--network-interfaces", "--network-interface", "--nics"),
                "comma-separated interfaces to use between hosts",
                "probe and pick one routable between all hosts",
                {"dest": "network_interfaces", "metavar": "NICS"},
            ),
        ),
    ),
    Group(
        "SSH",
        None,
        (
            Flag(("-p", "--ssh-port"), "SSH port", "22", {"type": int, "metavar": "PORT"}),
            Flag(
                ("-i", "--ssh-identity-file"),
                "SSH private key file",
                "ssh's own keys",
                {"metavar": "FILE"},
            ),
            Flag(
                ("--ssh-known-hosts",),
                "known_hosts file to trust in addition to ~/.ssh/known_hosts",
                "none",
                {"metavar": "FILE"},
            ),
            Flag(
                ("--ssh-strict-host-key-checking",),
                "refuse hosts whose key is not known",
                "off: warn and accept",
                _SWITCH,
            ),
            Flag(
                ("--launcher-agent",),
                "start remote hosts' tasks with 'CMD HOST COMMAND' instead of SSH (like Open "
                "MPI's plm_rsh_agent; e.g. a kubectl exec -i wrapper; it must pass stdin on)",
                "SSH",
                {"metavar": "CMD"},
            ),
        ),
    ),
    Group(
        "controller parameters",
        None,
        (
            OneOf(
                (
                    Flag(("--gloo",), "run collectives through Gloo", _CONTROLLER_DEFAULT, _SWITCH),
                    Flag(("--mpi",), "run the job under mpiexec", _CONTROLLER_DEFAULT, _SWITCH),
                    Flag(("--jsrun",), _refused("jsrun"), "off", _SWITCH),
                )
            ),
            Flag(
                ("--mpi-args",),
                "extra arguments for mpiexec (one string)",
                "none",
                {"metavar": "ARGS"},
            ),
            Flag(
                ("--binding-args",),
                "--mpi only: process binding arguments for mpiexec, replacing the default",
                "Open MPI: --bind-to none --map-by slot",
                {"metavar": "ARGS"},
            ),
            Flag(("--tcp",), _no_op("--tcp"), "off", _SWITCH),
            OneOf(
                (
                    Flag(
                        ("--mpi-threads-disable",),
                        _refused("mpi_threads_disable"),
                        "--no-mpi-threads-disable",
                        {"action": "store_const", "const": True},
                    ),
                    Flag(
                        ("--no-mpi-threads-disable",),
                        _no_op("--no-mpi-threads-disable"),
                        "--no-mpi-threads-disable",
                        {"dest": "mpi_threads_disable", "action": "store_const", "const": False},
                    ),
                )
            ),
            Flag(
                ("--num-nccl-streams",),
                _refused("num_nccl_streams"),
                "unset",
                {"type": int, "metavar": "N"},
            ),
            Flag(
                ("--thread-affinity",),
                _refused("thread_affinity"),
                "unset",
                {"type": int, "metavar": "CORE"},
            ),
        ),
    ),
    Group(
        "environment",
        None,
        (
            Flag(
                ("-x",),
                "also pass NAME (from this environment, or =VALUE) to every rank; "
                "repeatable. Remote ranks get only HVDLITE_*, HOROVOD_*, PATH, "
                "PYTHONPATH, LD_LIBRARY_PATH and these",
                "none",
                {"dest": "env", "action": "append", "default": None, "metavar": "NAME[=VALUE]"},
            ),
        ),
    ),
    Group(
        "output",
        None,
        (
            Flag(
                ("--output-filename",),
                "also write each rank's output to DIR/rank.N/{stdout,stderr}",
                "none",
                {"metavar": "DIR"},
            ),
            Flag(
                ("-prefix-timestamp", "--prefix-output-with-timestamp"),
                "put a timestamp before each output line's [rank] prefix",
                "off",
                {"action": "store_true", "dest": "prefix_output_with_timestamp"},
            ),
            OneOf(
                (
                    Flag(
                        ("--log-without-timestamp", "--log-hide-timestamp"),
                        _no_op("--log-without-timestamp"),
                        "--log-without-timestamp",
                        {"dest": "log_with_timestamp", "action": "store_const", "const": False},
                    ),
                    Flag(
                        ("--log-with-timestamp", "--no-log-hide-timestamp"),
                        _refused("log_with_timestamp"),
                        "--log-without-timestamp",
                        {"dest": "log_with_timestamp", "action": "store_const", "const": True},
                    ),
                )
            ),
        ),
    ),
    Group(
        "tunable parameters",
        None,
        (
            OneOf(
                (
                    Flag(
                        ("--torus-allreduce",),
                        _refused("torus_allreduce"),
                        "--no-torus-allreduce",
                        {"action": "store_const", "const": True},
                    ),
                    Flag(
                        ("--no-torus-allreduce",),
                        _no_op("--no-torus-allreduce"),
                        "--no-torus-allreduce",
                        {"dest": "torus_allreduce", "action": "store_const", "const": False},
                    ),
                )
            ),
        ),
    ),
    Group(
        "timeline parameters",
        "rank 0 writes a Chrome-trace JSON (open it in Perfetto or "
        "chrome://tracing; summarise it with 'python -m hvdlite.timeline summary FILE')",
    ),
    Group(
        "elastic arguments",
        "any of --min-np, --max-np, --host-discovery-script makes the "
        "job elastic: it survives failed workers and follows the hosts discovery offers",
        (
            Flag(
                ("--min-np", "--min-num-proc"),
                "fewest processes the job may run with",
                "-np",
                {"dest": "min_np", "type": int, "metavar": "N"},
            ),
            Flag(
                ("--max-np", "--max-num-proc"),
                "most processes the job may grow to",
                "--max-workers (1024)",
                {"dest": "max_np", "type": int, "metavar": "N"},
            ),
            Flag(
                ("--slots-per-host",),
                "slots of a discovered host printed without ':N'",
                "1",
                {"type": int, "metavar": "N"},
            ),
            Flag(
                ("--host-discovery-script",),
                "executable printing the available hosts, one "
                "'host[:slots]' per line; run about once a second",
                "none: the -H/--hostfile list is fixed",
                {"metavar": "FILE"},
            ),
            Flag(
                ("--reset-limit",),
                "fail once the job would need more than N resets",
                "no limit",
                {"type": int, "metavar": "N"},
            ),
            Flag(
                ("--blacklist-cooldown-range",),
                "a failed host rejoins after a cooldown drawn from [MIN, MAX] seconds",
                "it stays out",
                {"type": float, "nargs": 2, "metavar": ("MIN", "MAX")},
            ),
        ),
    ),
    Group("stall check parameters", None),
    Group("monitoring", "live Prometheus metrics served by hvdlite-run, and the straggler report"),
    Group(
        "autotune parameters",
        "rank 0 searches the fusion threshold, cycle time, in-place "
        "threshold, chunk size and response-cache use by Bayesian optimisation during the "
        "first steps, then keeps the best; every rank switches in the same cycle",
    ),
)


#: the --help section that names, in two lines, every horovodrun flag hvdlite-run takes only
#: for compatibility (the flags themselves are not listed one by one)
COMPAT_TITLE = "horovodrun flags kept for compatibility"


def _compat_flag(name: str) -> bool:
    """A flag accepted only because horovodrun has it: no effect here, or refused."""
    return name in NO_OP_FLAGS or any(name in flag.split("/") for flag, _ in REFUSED_FLAGS.values())


def _compat_description() -> str:
    refused = [name for flag, _ in REFUSED_FLAGS.values() for name in flag.split("/")]
    return (
        f"accepted, no effect here: {', '.join(NO_OP_FLAGS)}. Refused with the reason "
        f"when given: {', '.join(refused)}. docs/reference.md says why for each."
    )


def _with_default(text: str, default: str) -> str:
    return f"{text} (default: {default})" if default else text


def _add_flag(target, flag: Flag) -> None:
    text = (
        argparse.SUPPRESS if _compat_flag(flag.names[0]) else _with_default(flag.help, flag.default)
    )
    target.add_argument(*flag.names, help=text, **flag.options)


def _add_option(target, t: tunables.Tunable, option: tunables.Option) -> None:
    kind = option.type or (t.type if t.type in (int, float) else None)
    target.add_argument(
        *option.names,
        dest=option.dest,
        type=kind,
        metavar=option.metavar,
        choices=option.choices,
        help=_with_default(option.help or t.help, tunables.flag_default(t, option)),
    )


def _add_switch(target, t: tunables.Tunable, switch: tunables.Switch) -> None:
    default = tunables.switch_default(t, switch)
    pair = target.add_mutually_exclusive_group()
    off_help = _no_op(switch.off[0]) if switch.off_is_default_only else switch.off_help
    for names, text, value in ((switch.on, switch.on_help, True), (switch.off, off_help, False)):
        mark = "(the default)" if default == names[0] else f"(default: {default})"
        pair.add_argument(
            *names,
            dest=switch.dest,
            action="store_const",
            const=value,
            help=argparse.SUPPRESS if _compat_flag(names[0]) else f"{text} {mark}",
        )


def _add_tunables(target, title: Optional[str]) -> None:
    """The flags of every tunable of the ``--help`` section ``title``, in table order."""
    for t in tunables.TUNABLES:
        if t.group != title:
            continue
        for flag in t.flags:
            if isinstance(flag, tunables.Switch):
                _add_switch(target, t, flag)
            else:
                _add_option(target, t, flag)


#: the end of --help: the commands a new user looks for first
EXAMPLES = """examples:
  hvdlite-run -np 2 python train.py                     two ranks on this host
  hvdlite-run -np 4 -H a:2,b:2 python train.py          two hosts over SSH (first:
  hvdlite-run --check-hosts -H a,b python train.py        what each host needs, checked)
  hvdlite-run -np 2 python ddp_train.py                 a torch.distributed/DDP program as is
  hvdlite-run -np 4 --mpi python train.py               MPI instead of Gloo
  hvdlite-run --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py
                                                        an elastic job
  hvdlite-run -np 2 --timeline-filename t.json python train.py
                                                        a timeline (python -m hvdlite.timeline
                                                        summary t.json)
  hvdlite-run -cb                                       what this install can run

docs: README.md, docs/reference.md (every flag and variable), docs/ssh_hosts.md
"""


class _Formatter(argparse.HelpFormatter):
    """argparse's wrapping, except for the examples, whose columns are laid out by hand."""

    def _fill_text(self, text, width, indent):
        if text is EXAMPLES:
            return text
        return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    """hvdlite-run's parser: our flags plus every horovodrun flag and alias."""
    p = argparse.ArgumentParser(
        prog="hvdlite-run",
        usage="hvdlite-run -np N [-H host:slots,... | --hostfile FILE] [options] "
        "[python] train.py [args...]",
        description="Launch a distributed training job (horovodrun-compatible flags). "
        "Local hosts start directly; others over SSH.",
        epilog=EXAMPLES,
        formatter_class=_Formatter,
    )
    for group in GROUPS:
        target = p if group.title is None else p.add_argument_group(group.title, group.description)
        for entry in group.entries:
            if isinstance(entry, OneOf):
                exclusive = target.add_mutually_exclusive_group()
                for flag in entry.flags:
                    _add_flag(exclusive, flag)
            else:
                _add_flag(target, entry)
        _add_tunables(target, group.title)
    p.add_argument_group(COMPAT_TITLE, _compat_description())
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the training command: 'python train.py ...' or 'train.py ...'",
    )
    return p


@functools.lru_cache(maxsize=None)
def shared_parser() -> argparse.ArgumentParser:
    """The parser, built once per process (about 400 actions): for a command line without
    ``--config-file`` and for naming flags in messages.  Never changed: a config file's
    values become the defaults of a parser of its own (:func:`build_parser`)."""
    return build_parser()
