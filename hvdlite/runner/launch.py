"""``hvdlite-run``: parse the command line, build Settings, dispatch.

Kept to parse -> Settings -> dispatch; each launch mechanism lives in its own module.
"""

import argparse
import dataclasses
import logging
import os
import shutil
import sys
from typing import Dict, List, Optional

from hvdlite.common import config as cfg
from hvdlite.runner.hosts import assign_slots, parse_hosts

log = logging.getLogger("hvdlite.runner")


@dataclasses.dataclass
class Settings:
    """Everything one launch needs, derived from flags."""

    np: int
    hosts: str
    command: List[str]
    verbose: bool = False
    output_dir: Optional[str] = None
    tunable_env: Dict[str, str] = dataclasses.field(default_factory=dict)


# flag dest -> (HVDLITE_* variable, converter to the variable's text)
TUNABLE_FLAGS = {
    "fusion_threshold_mb": (cfg.FUSION_THRESHOLD, lambda v: str(int(float(v) * 1024 * 1024))),
    "cycle_time_ms": (cfg.CYCLE_TIME, str),
    "cache_capacity": (cfg.CACHE_CAPACITY, str),
    "timeline_filename": (cfg.TIMELINE, str),
    "timeline_mark_cycles": (cfg.TIMELINE_MARK_CYCLES, lambda v: "1" if v else ""),
    "no_stall_check": (cfg.STALL_CHECK_DISABLE, lambda v: "1" if v else ""),
    "stall_check_warning_time_seconds": (cfg.STALL_CHECK_WARNING_TIME, str),
    "stall_check_shutdown_time_seconds": (cfg.STALL_CHECK_SHUTDOWN_TIME, str),
    "autotune": (cfg.AUTOTUNE, lambda v: "1" if v else ""),
    "autotune_log_file": (cfg.AUTOTUNE_LOG, str),
    "log_level": (cfg.LOG_LEVEL, str),
    "start_timeout": (cfg.START_TIMEOUT, str),
    "op_timeout_seconds": (cfg.OP_TIMEOUT, str),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdlite-run",
        description="Launch a distributed training job (horovodrun-compatible flags).")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="total number of training processes")
    p.add_argument("-H", "--hosts", default=None,
                   help="host:slots list, e.g. localhost:2 (default: localhost:NP)")
    p.add_argument("--verbose", action="store_true", help="report each launch step")
    p.add_argument("--output-filename", default=None,
                   help="also write each rank's output to DIR/rank.N/{stdout,stderr}")
    ctl = p.add_mutually_exclusive_group()
    ctl.add_argument("--gloo", action="store_true", help="run collectives through Gloo (default)")
    ctl.add_argument("--mpi", action="store_true", help="run collectives through MPI (mpiexec)")
    t = p.add_argument_group("tunable parameters")
    t.add_argument("--fusion-threshold-mb", type=float, help="fusion buffer size in MiB (0: off)")
    t.add_argument("--cycle-time-ms", type=float, help="background loop period in ms")
    t.add_argument("--cache-capacity", type=int, help="response cache entries (0: off)")
    t.add_argument("--op-timeout-seconds", type=float,
                   help="how long a collective may wait on a silent peer before failing")
    t.add_argument("--start-timeout", type=float, help="seconds allowed for workers to rendezvous")
    t.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    s = p.add_argument_group("timeline, stall check and autotune")
    s.add_argument("--timeline-filename")
    s.add_argument("--timeline-mark-cycles", action="store_true")
    s.add_argument("--no-stall-check", action="store_true")
    s.add_argument("--stall-check-warning-time-seconds", type=float)
    s.add_argument("--stall-check-shutdown-time-seconds", type=float)
    s.add_argument("--autotune", action="store_true")
    s.add_argument("--autotune-log-file")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("no training command given (e.g. hvdlite-run -np 2 python train.py)")
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    exe = command[0]
    if shutil.which(exe) is None and not os.path.exists(exe):
        raise ValueError(f"command {exe!r} not found")
    if exe == sys.executable or os.path.basename(exe).startswith("python"):
        script = next((a for a in command[1:] if not a.startswith("-")), None)
        if script and script.endswith(".py") and not os.path.exists(script):
            raise ValueError(f"training script {script!r} not found")
    tunable_env = {}
    for dest, (var, conv) in TUNABLE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:
            tunable_env[var] = conv(value)
    if args.mpi:
        tunable_env[cfg.CPU_OPERATIONS] = "mpi"
    elif args.gloo:
        tunable_env[cfg.CPU_OPERATIONS] = "gloo"
    hosts = args.hosts or f"localhost:{max(args.np, 1)}"
    return Settings(np=args.np, hosts=hosts, command=command, verbose=args.verbose,
                    output_dir=args.output_filename, tunable_env=tunable_env)


def run(settings: Settings) -> int:
    slots = assign_slots(parse_hosts(settings.hosts), settings.np)
    from hvdlite.runner.gloo_run import launch_local
    return launch_local(slots, settings.command, settings.tunable_env,
                        output_dir=settings.output_dir, verbose=settings.verbose)


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="hvdlite-run: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
        return run(settings)
    except ValueError as exc:
        sys.stderr.write(f"hvdlite-run: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
