"""``hvdlite-run``: parse the command line (and --config-file), build Settings, dispatch.

Kept to parse -> Settings -> dispatch; each launch mechanism lives in its own
module (``gloo_run`` for local and multi-host Gloo jobs, ``mpi_run`` for MPI).
"""

import argparse
import dataclasses
import importlib.util
import logging
import os
import shlex
import shutil
import sys
from typing import Any, Dict, List, Optional

from hvdlite import __version__
from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteError
from hvdlite.runner import gloo_run
from hvdlite.runner.elastic.discovery import FixedHosts, ScriptDiscovery
from hvdlite.runner.elastic.run import launch_elastic
from hvdlite.runner.elastic.settings import DEFAULT_ELASTIC_TIMEOUT_S, ElasticSettings, validate
from hvdlite.runner.hosts import (HostSlots, assign_slots, is_local, parse_hostfile,
                                  parse_hosts, resolve)
from hvdlite.runner.mpi_run import find_mpiexec, launch_mpi
from hvdlite.runner.ssh import SSHOptions

log = logging.getLogger("hvdlite.runner")

#: variables every host's workers get from the launcher's environment (besides -x ones)
FORWARD_ALWAYS = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
#: per-job HVDLITE_* names the launcher sets itself; never forwarded from its own environment
_JOB_NAMES = {cfg.RANK, cfg.SIZE, cfg.LOCAL_RANK, cfg.LOCAL_SIZE, cfg.CROSS_RANK,
              cfg.CROSS_SIZE, cfg.HOSTNAME, cfg.RENDEZVOUS_ADDR, cfg.RENDEZVOUS_PORT,
              cfg.SECRET_KEY, cfg.JOB_ID, cfg.GLOO_IFACE, cfg.ELASTIC, cfg.ELASTIC_TIMEOUT}


@dataclasses.dataclass
class Settings:
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
    network_interfaces: Optional[List[str]] = None
    mpi_args: List[str] = dataclasses.field(default_factory=list)
    #: HVDLITE_* tunables from flags
    tunable_env: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: -x NAME=VALUE (and -x NAME resolved from our environment)
    user_env: Dict[str, str] = dataclasses.field(default_factory=dict)
    #: the elastic flags; None for a static job
    elastic: Optional[ElasticSettings] = None
    #: --host-discovery-script (elastic jobs; None: the host list is fixed)
    discovery_script: Optional[str] = None
    #: --slots-per-host: slots of a discovered host printed without ``:N``
    slots_per_host: int = 1

    def forward_env(self) -> Dict[str, str]:
        """The allow-list remote hosts get: HVDLITE_* tunables, PATH & co, and -x names."""
        env = {k: v for k, v in os.environ.items()
               if (k.startswith(cfg.PREFIX) and k not in _JOB_NAMES) or k in FORWARD_ALWAYS}
        env.update(self.user_env)
        env.update(self.tunable_env)
        return env


# flag dest -> (HVDLITE_* variable, converter to the variable's text)
TUNABLE_FLAGS = {
    "fusion_threshold_mb": (cfg.FUSION_THRESHOLD, lambda v: str(int(float(v) * 1024 * 1024))),
    "inplace_threshold_mb": (cfg.INPLACE_THRESHOLD, lambda v: str(int(float(v) * 1024 * 1024))),
    "gloo_threads": (cfg.GLOO_THREADS, str),
    "fusion_chunk_mb": (cfg.FUSION_CHUNK, lambda v: str(max(1, int(float(v) * 1024 * 1024)))),
    "cycle_time_ms": (cfg.CYCLE_TIME, str),
    "cache_capacity": (cfg.CACHE_CAPACITY, str),
    "no_stall_check": (cfg.STALL_CHECK_DISABLE, lambda v: "1" if v else ""),
    "stall_check_warning_time_seconds": (cfg.STALL_CHECK_WARNING_TIME, str),
    "stall_check_shutdown_time_seconds": (cfg.STALL_CHECK_SHUTDOWN_TIME, str),
    "log_level": (cfg.LOG_LEVEL, str),
    "start_timeout": (cfg.START_TIMEOUT, str),
    "op_timeout_seconds": (cfg.OP_TIMEOUT, str),
}

#: horovodrun flags for features hvdlite does not offer: parsed, so that Horovod users get a
#: clear answer instead of argparse's "unrecognized arguments", then refused.
#: flag dest -> (flag, the missing feature)
REFUSED_FLAGS = {
    "timeline_filename": ("--timeline-filename", "a timeline"),
    "timeline_mark_cycles": ("--timeline-mark-cycles", "a timeline"),
    "autotune": ("--autotune", "autotuning"),
    "autotune_log_file": ("--autotune-log-file", "autotuning"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdlite-run",
        usage="hvdlite-run -np N [-H host:slots,... | --hostfile FILE] [options] "
              "[python] train.py [args...]",
        description="Launch a distributed training job (horovodrun-compatible flags). "
                    "Local hosts start directly; others over SSH.")
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("-np", "--num-proc", dest="np", type=int,
                   help="total number of training processes")
    p.add_argument("--check-build", action="store_true",
                   help="show which frameworks and controllers are available, and exit")
    p.add_argument("--config-file", metavar="FILE",
                   help="YAML file with the same keys as the long flags "
                        "(e.g. 'fusion-threshold-mb: 32'); flags given on the command line win")
    p.add_argument("--verbose", action="store_true", help="report each launch step")

    h = p.add_argument_group("host arguments")
    hx = h.add_mutually_exclusive_group()
    hx.add_argument("-H", "--hosts", metavar="HOSTS",
                    help="[user@]host:slots list, e.g. localhost:2,node2:4 "
                         "(default: localhost:NP)")
    hx.add_argument("--hostfile", metavar="FILE",
                    help="file with one 'host slots=N' per line (# comments allowed)")
    h.add_argument("--start-timeout", type=float, metavar="SECONDS",
                   help=f"bound on connecting to hosts, task registration and worker rendezvous "
                        f"(default {cfg.Config.start_timeout_s:.0f})")
    h.add_argument("--network-interfaces", metavar="NICS",
                   help="comma-separated interfaces to use between hosts (default: probe and "
                        "pick one routable between all hosts)")

    s = p.add_argument_group("SSH")
    s.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="SSH port (default 22)")
    s.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="SSH private key file")
    s.add_argument("--ssh-known-hosts", metavar="FILE",
                   help="known_hosts file to trust in addition to ~/.ssh/known_hosts")
    s.add_argument("--ssh-strict-host-key-checking", action="store_true",
                   help="refuse hosts whose key is not known (default: warn and accept)")

    c = p.add_argument_group("controller parameters")
    cx = c.add_mutually_exclusive_group()
    cx.add_argument("--gloo", action="store_true", help="run collectives through Gloo")
    cx.add_argument("--mpi", action="store_true", help="run the job under mpiexec")
    c.add_argument("--mpi-args", metavar="ARGS", help="extra arguments for mpiexec (one string)")

    e = p.add_argument_group("environment")
    e.add_argument("-x", dest="env", action="append", default=None, metavar="NAME[=VALUE]",
                   help="also pass NAME (from this environment, or =VALUE) to every rank; "
                        "repeatable. Remote ranks get only HVDLITE_*, PATH, PYTHONPATH, "
                        "LD_LIBRARY_PATH and these")

    o = p.add_argument_group("output")
    o.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.N/{stdout,stderr}")
    o.add_argument("--prefix-output-with-timestamp", action="store_true",
                   help="put a timestamp before each output line's [rank] prefix")
    o.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level of the launcher and the workers")

    t = p.add_argument_group("tunable parameters")
    t.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                   help="fusion buffer size in MiB (0: off; default 128)")
    t.add_argument("--inplace-threshold-mb", type=float, metavar="MB",
                   help="reduce fused tensors at least this big in place instead of copying "
                        "them through the fusion buffer (0: always copy; default 2)")
    t.add_argument("--gloo-threads", type=int, metavar="N",
                   help="Gloo worker threads: collectives in flight at once (default 4)")
    t.add_argument("--fusion-chunk-mb", type=float, metavar="MB",
                   help="pipeline fused allreduces in chunks of this many MiB (default 16)")
    t.add_argument("--cycle-time-ms", type=float, metavar="MS",
                   help="background loop period in ms")
    t.add_argument("--cache-capacity", type=int, metavar="N",
                   help="response cache entries (0: off; default 1024)")
    t.add_argument("--op-timeout-seconds", type=float, metavar="SECONDS",
                   help="how long a collective may wait on a silent peer before failing")

    tl = p.add_argument_group("timeline parameters", "horovodrun's timeline flags; refused: "
                              "hvdlite does not offer a timeline yet")
    tl.add_argument("--timeline-filename", metavar="FILE", help="refused")
    tl.add_argument("--timeline-mark-cycles", action="store_true", help="refused")

    el = p.add_argument_group(
        "elastic arguments", "any of --min-np, --max-np, --host-discovery-script makes the "
        "job elastic: it survives failed workers and follows the hosts discovery offers")
    el.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="N",
                    help="fewest processes the job may run with (default: -np)")
    el.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="N",
                    help="most processes the job may grow to (default: no limit)")
    el.add_argument("--slots-per-host", type=int, metavar="N",
                    help="slots of a discovered host printed without ':N' (default 1)")
    el.add_argument("--host-discovery-script", metavar="FILE",
                    help="executable printing the available hosts, one 'host[:slots]' per "
                         "line; run about once a second")
    el.add_argument("--elastic-timeout", type=float, metavar="SECONDS",
                    help=f"how long to wait for --min-np slots before failing "
                         f"(default {DEFAULT_ELASTIC_TIMEOUT_S:.0f})")
    el.add_argument("--reset-limit", type=int, metavar="N",
                    help="fail once the job would need more than N resets (default: no limit)")
    el.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                    help="a failed host rejoins after a cooldown drawn from [MIN, MAX] seconds "
                         "(default: it stays out)")

    st = p.add_argument_group("stall check parameters")
    st.add_argument("--no-stall-check", action="store_true", help="disable the stall check")
    st.add_argument("--stall-check-warning-time-seconds", type=float, metavar="SECONDS")
    st.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="SECONDS")

    at = p.add_argument_group("autotune parameters", "horovodrun's autotune flags; refused: "
                              "hvdlite does not offer autotuning yet")
    at.add_argument("--autotune", action="store_true", help="refused")
    at.add_argument("--autotune-log-file", metavar="FILE", help="refused")

    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training command: 'python train.py ...' or 'train.py ...'")
    return p


def _config_file_defaults(parser: argparse.ArgumentParser, path: str) -> Dict[str, Any]:
    """Read --config-file into {dest: value}.

    Raises:
        HvdliteConfigError: unreadable file, not a mapping, or an unknown key.
    """
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise HvdliteConfigError(f"--config-file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise HvdliteConfigError(f"--config-file {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HvdliteConfigError(f"--config-file {path}: expected a mapping of flag names")
    flat: Dict[str, Any] = {}
    for k, v in data.items():      # one level of sections (horovodrun style) is allowed
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    by_name = {}
    for action in parser._actions:
        for opt in action.option_strings:
            by_name[opt.lstrip("-")] = action
        by_name.setdefault(action.dest.replace("_", "-"), action)
    out = {}
    for k, v in flat.items():
        name = str(k).replace("_", "-")
        action = by_name.get(name)
        if action is None or name in ("config-file", "command", "help"):
            raise HvdliteConfigError(f"--config-file {path}: unknown key {k!r}")
        if isinstance(v, str) and action.type is not None:
            try:
                v = action.type(v)
            except ValueError:
                raise HvdliteConfigError(
                    f"--config-file {path}: {k}: {v!r} is not a valid value") from None
        if action.dest == "env" and isinstance(v, str):
            v = [v]
        out[action.dest] = v
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config_file:
        parser.set_defaults(**_config_file_defaults(parser, args.config_file))
        args = parser.parse_args(argv)
    return args


def _resolve_command(command: List[str]) -> List[str]:
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise HvdliteConfigError(
            "no training command given (e.g. hvdlite-run -np 2 python train.py)")
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


def controllers_available() -> Dict[str, bool]:
    has_torch = importlib.util.find_spec("torch") is not None
    return {"gloo": has_torch,
            "mpi": find_mpiexec() is not None and importlib.util.find_spec("mpi4py") is not None}


def check_build() -> str:
    """What ``--check-build`` prints: the one framework hvdlite supports and its controllers."""
    ctl = controllers_available()

    def box(x):
        return "[X]" if x else "[ ]"

    lines = [f"hvdlite v{__version__}:", "", "Available Frameworks:",
             f"    {box(importlib.util.find_spec('torch') is not None)} PyTorch"]
    lines += ["", "Available Controllers:", f"    {box(ctl['gloo'])} Gloo",
              f"    {box(ctl['mpi'])} MPI", ""]
    return "\n".join(lines)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate the flags into Settings.

    Raises:
        HvdliteConfigError: any bad flag value, host list or command, or a flag for a
            feature hvdlite does not offer (names the flag).
    """
    for dest, (flag, feature) in REFUSED_FLAGS.items():
        if getattr(args, dest, None) not in (None, False):
            raise HvdliteConfigError(
                f"{flag}: hvdlite does not offer {feature} yet; remove the flag")
    elastic = _is_elastic(args)
    if args.np is None and elastic and args.min_np is not None:
        args.np = args.min_np
    if args.np is None:
        raise HvdliteConfigError("-np is required (the number of processes)"
                                 + (" or --min-np" if elastic else ""))
    if args.np < 1:
        raise HvdliteConfigError(f"-np {args.np}: the number of processes must be at least 1")
    if not elastic:
        for dest, flag in _ELASTIC_ONLY.items():
            if getattr(args, dest, None) is not None:
                raise HvdliteConfigError(
                    f"{flag} applies to elastic jobs only; add --min-np, --max-np or "
                    f"--host-discovery-script, or drop it")
    elastic_settings = None
    if elastic:
        elastic_settings = validate(
            np=args.np, min_np=args.min_np, max_np=args.max_np,
            elastic_timeout_s=args.elastic_timeout, reset_limit=args.reset_limit,
            cooldown_range=args.blacklist_cooldown_range, slots_per_host=args.slots_per_host,
            discovery_script=args.host_discovery_script,
            fixed_hosts=bool(args.hosts or args.hostfile), mpi=args.mpi)
    command = _resolve_command(list(args.command))
    if args.host_discovery_script:
        hosts = []
    elif args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    else:
        hosts = parse_hosts(args.hosts or f"localhost:{args.np}")
    if hosts:
        assign_slots(hosts, args.np)       # -np > slots is an error before anything starts
    tunable_env = {}
    for dest, (var, conv) in TUNABLE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:
            tunable_env[var] = conv(value)
    if args.mpi:
        controller = "mpi"
    elif args.gloo or elastic:
        controller = "gloo"
    else:
        avail = controllers_available()
        controller = "mpi" if (avail["mpi"] and not avail["gloo"]) else "gloo"
    tunable_env[cfg.CPU_OPERATIONS] = controller
    start_timeout = args.start_timeout if args.start_timeout is not None \
        else cfg.Config.start_timeout_s
    if start_timeout <= 0:
        raise HvdliteConfigError(f"--start-timeout {start_timeout}: must be > 0 seconds")
    if args.ssh_port is not None and not 0 < args.ssh_port < 65536:
        raise HvdliteConfigError(f"-p/--ssh-port {args.ssh_port}: not a port number")
    if args.ssh_identity_file and not os.path.isfile(args.ssh_identity_file):
        raise HvdliteConfigError(
            f"-i/--ssh-identity-file {args.ssh_identity_file}: no such file")
    nics = None
    if args.network_interfaces:
        nics = [n.strip() for n in args.network_interfaces.split(",") if n.strip()]
    return Settings(
        np=args.np, hosts=hosts, command=command, controller=controller, verbose=args.verbose,
        output_dir=args.output_filename, timestamp_output=args.prefix_output_with_timestamp,
        start_timeout_s=start_timeout, ssh_port=args.ssh_port or 22,
        ssh_identity_file=args.ssh_identity_file, ssh_known_hosts_file=args.ssh_known_hosts,
        ssh_strict_host_key_checking=args.ssh_strict_host_key_checking,
        network_interfaces=nics, mpi_args=shlex.split(args.mpi_args or ""),
        tunable_env=tunable_env, user_env=_user_env(args.env), elastic=elastic_settings,
        discovery_script=args.host_discovery_script,
        slots_per_host=args.slots_per_host or 1)


def _is_elastic(args: argparse.Namespace) -> bool:
    return any(getattr(args, f, None) is not None
               for f in ("min_np", "max_np", "host_discovery_script"))


#: flags that mean something only in an elastic job
_ELASTIC_ONLY = {"slots_per_host": "--slots-per-host", "elastic_timeout": "--elastic-timeout",
                 "reset_limit": "--reset-limit",
                 "blacklist_cooldown_range": "--blacklist-cooldown-range"}


def run(settings: Settings) -> int:
    """Dispatch to the launch mechanism; returns the job's exit code."""
    if settings.elastic is not None:
        return _run_elastic(settings)
    slots = assign_slots(settings.hosts, settings.np)
    used = [h for h in settings.hosts if any(s.hostname == h.hostname for s in slots)]
    for h in used:
        if not is_local(h.hostname):
            resolve(h.hostname)          # "unknown host" before anything starts
    if settings.controller == "mpi":
        names = [n for n in FORWARD_ALWAYS if n in os.environ]
        env = dict(settings.tunable_env)
        env.update(settings.user_env)
        return launch_mpi(settings.np, used, settings.command, env, names,
                          settings.mpi_args, ssh_port=settings.ssh_port
                          if settings.ssh_port != 22 else None,
                          identity_file=settings.ssh_identity_file, verbose=settings.verbose,
                          output_dir=settings.output_dir, timestamp=settings.timestamp_output)
    if all(is_local(h.hostname) for h in used):
        if settings.verbose:
            log.warning("all hosts are local: starting %d ranks without SSH", settings.np)
        return gloo_run.launch_local(slots, settings.command, settings.tunable_env,
                                     output_dir=settings.output_dir, verbose=settings.verbose,
                                     timestamp=settings.timestamp_output,
                                     extra_env=settings.user_env)
    ssh = SSHOptions(port=settings.ssh_port, identity_file=settings.ssh_identity_file,
                     known_hosts_file=settings.ssh_known_hosts_file,
                     strict_host_key_checking=settings.ssh_strict_host_key_checking)
    return gloo_run.launch_multi(used, slots, settings.command, settings.tunable_env,
                                 settings.forward_env(), ssh, settings.start_timeout_s,
                                 network_interfaces=settings.network_interfaces,
                                 output_dir=settings.output_dir, verbose=settings.verbose,
                                 timestamp=settings.timestamp_output)


def _run_elastic(settings: Settings) -> int:
    for h in settings.hosts:
        if not is_local(h.hostname):
            resolve(h.hostname)          # "unknown host" before anything starts
    if settings.discovery_script:
        discovery = ScriptDiscovery(settings.discovery_script, settings.slots_per_host)
    else:
        discovery = FixedHosts(settings.hosts)
    ssh = SSHOptions(port=settings.ssh_port, identity_file=settings.ssh_identity_file,
                     known_hosts_file=settings.ssh_known_hosts_file,
                     strict_host_key_checking=settings.ssh_strict_host_key_checking)
    return launch_elastic(settings.elastic, discovery, settings.command, settings.tunable_env,
                          settings.user_env, settings.forward_env(), ssh,
                          settings.start_timeout_s,
                          network_interfaces=settings.network_interfaces,
                          output_dir=settings.output_dir, verbose=settings.verbose,
                          timestamp=settings.timestamp_output,
                          tasks_from_start=any(not is_local(h.hostname)
                                               for h in settings.hosts))


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="hvdlite-run: %(message)s")
    try:
        args = parse_args(argv)
        if args.version:
            print(f"hvdlite-run {__version__}")
            return 0
        if args.check_build:
            print(check_build())
            return 0
        if args.log_level:
            logging.getLogger("hvdlite").setLevel(args.log_level)
        elif args.verbose:
            logging.getLogger("hvdlite").setLevel(logging.INFO)
        settings = settings_from_args(args)
        return run(settings)
    except HvdliteError as exc:
        sys.stderr.write(f"hvdlite-run: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
