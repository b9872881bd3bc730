"""hvdlite-run's command line: every flag, horovodrun's included, and what each one becomes.

Kept apart from ``launch.py`` (which turns parsed flags into Settings and
dispatches) because horovodrun compatibility makes the flag list long.  Each of
horovodrun's flags is here under its own spelling and aliases, and is either
implemented, accepted because it asks for what hvdlite always does (:data:`NO_OP_FLAGS`),
or refused with the reason (:data:`REFUSED_FLAGS`); none gets argparse's bare
"unrecognized arguments".
"""

import argparse
from typing import Dict, Optional, Tuple

from hvdlite.common import config as cfg
from hvdlite.runner.agent.settings import DEFAULT_ELASTIC_TIMEOUT_S


def _mib(value) -> str:
    return str(int(float(value) * 1024 * 1024))


#: flag dest -> (HVDLITE_* variable, converter to the variable's text)
TUNABLE_FLAGS = {
    "fusion_threshold_mb": (cfg.FUSION_THRESHOLD, _mib),
    "inplace_threshold_mb": (cfg.INPLACE_THRESHOLD, _mib),
    "gloo_threads": (cfg.GLOO_THREADS, str),
    "fusion_chunk_mb": (cfg.FUSION_CHUNK, lambda v: str(max(1, int(float(v) * 1024 * 1024)))),
    "cycle_time_ms": (cfg.CYCLE_TIME, str),
    "cache_capacity": (cfg.CACHE_CAPACITY, str),
    # --stall-check (False) writes "0" so that it also beats an exported Horovod twin
    "no_stall_check": (cfg.STALL_CHECK_DISABLE, lambda v: "1" if v else "0"),
    "stall_check_warning_time_seconds": (cfg.STALL_CHECK_WARNING_TIME, str),
    "stall_check_shutdown_time_seconds": (cfg.STALL_CHECK_SHUTDOWN_TIME, str),
    "log_level": (cfg.LOG_LEVEL, str),
    "start_timeout": (cfg.START_TIMEOUT, str),
    "op_timeout_seconds": (cfg.OP_TIMEOUT, str),
    # horovodrun's name for the same bound (HOROVOD_GLOO_TIMEOUT_SECONDS)
    "gloo_timeout_seconds": (cfg.OP_TIMEOUT, str),
    # horovodrun's hierarchical flags ask for what the shared-memory path does; "false" is
    # Horovod's default and leaves ours alone (a converter's None sets nothing)
    "hierarchical_allreduce": (cfg.SHARED_MEMORY, lambda v: "1" if v else None),
    "hierarchical_allgather": (cfg.SHARED_MEMORY, lambda v: "1" if v else None),
    # after the hierarchical flags: an explicit --no-shared-memory wins
    "shared_memory": (cfg.SHARED_MEMORY, lambda v: "1" if v else "0"),
    "gc_freeze": (cfg.GC_FREEZE, lambda v: "1" if v else "0"),
    # timeline and autotuning: rank 0 writes the trace / decides the parameters
    "timeline_filename": (cfg.TIMELINE, str),
    "timeline_mark_cycles": (cfg.TIMELINE_MARK_CYCLES, lambda v: "1" if v else "0"),
    "autotune": (cfg.AUTOTUNE, lambda v: "1" if v else "0"),
    "autotune_log_file": (cfg.AUTOTUNE_LOG, str),
    "autotune_warmup_samples": (cfg.AUTOTUNE_WARMUP_SAMPLES, str),
    "autotune_steps_per_sample": (cfg.AUTOTUNE_STEPS_PER_SAMPLE, str),
    "autotune_bayes_opt_max_samples": (cfg.AUTOTUNE_BAYES_OPT_MAX_SAMPLES, str),
    "autotune_gaussian_process_noise": (cfg.AUTOTUNE_GAUSSIAN_PROCESS_NOISE, str),
}

#: horovodrun flags for what hvdlite does not do: parsed, so that Horovod users get the
#: reason instead of argparse's "unrecognized arguments", then refused when the parsed value
#: asks for the feature (anything but unset or False).  dest -> (flag, reason)
REFUSED_FLAGS: Dict[str, Tuple[str, str]] = {
    "num_nccl_streams": ("--num-nccl-streams",
                         "NCCL is GPU only and hvdlite is a CPU build without NCCL"),
    "thread_affinity": ("--thread-affinity", "hvdlite's background loop is a Python thread "
                        "and pinning it to a core is not implemented"),
    "mpi_threads_disable": ("--mpi-threads-disable", "hvdlite calls MPI from its background "
                            "thread, so MPI's thread support cannot be turned off"),
    "log_with_timestamp": ("--log-with-timestamp/--no-log-hide-timestamp",
                           "hvdlite's log lines carry no timestamp; use "
                           "--prefix-output-with-timestamp to timestamp every output line"),
    "jsrun": ("--jsrun", "jsrun (IBM LSF) is not supported; launch with Gloo (the default) "
              "or --mpi"),
}

#: horovodrun flags accepted because they ask for what hvdlite always does: flag -> why
NO_OP_FLAGS: Dict[str, str] = {
    "--disable-cache": "hvdlite-run never caches its host checks; every run checks afresh",
    "--tcp": "hvdlite's own traffic (Gloo, control plane) is TCP; in --mpi mode, as with "
             "horovodrun on MPICH and Open MPI, MPI keeps its transport (see --mpi-args)",
    "--no-hierarchical-allreduce": "Horovod's default; hvdlite's ranks on one host still "
                                   "share memory (turn that off with --no-shared-memory)",
    "--no-hierarchical-allgather": "Horovod's default; hvdlite's ranks on one host still "
                                   "share memory (turn that off with --no-shared-memory)",
    "--no-mpi-threads-disable": "hvdlite keeps MPI's thread support",
    "--log-without-timestamp": "hvdlite's log lines carry no timestamp",
    "--log-hide-timestamp": "hvdlite's log lines carry no timestamp",
}


def refusal(args: argparse.Namespace) -> Optional[str]:
    """The error for the first refused flag the parsed ``args`` ask for, else None."""
    for dest, (flag, reason) in REFUSED_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:           # 0 is a value, too
            return f"{flag}: {reason}; remove the flag"
    return None


def _no_op(flag: str) -> str:
    return f"accepted for horovodrun: {NO_OP_FLAGS[flag]}"


def _refused(dest: str) -> str:
    return f"refused: {REFUSED_FLAGS[dest][1]}"


def build_parser() -> argparse.ArgumentParser:
    """hvdlite-run's parser: our flags plus every horovodrun flag and alias."""
    p = argparse.ArgumentParser(
        prog="hvdlite-run",
        usage="hvdlite-run -np N [-H host:slots,... | --hostfile FILE] [options] "
              "[python] train.py [args...]",
        description="Launch a distributed training job (horovodrun-compatible flags). "
                    "Local hosts start directly; others over SSH.")
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("-np", "--num-proc", dest="np", type=int,
                   help="total number of training processes")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks and controllers are available, and exit")
    p.add_argument("--config-file", metavar="FILE",
                   help="YAML file: horovodrun's format (params:, timeline:, autotune:, "
                        "stall_check:, library_options:, logging:, controller:) and any long "
                        "flag name (e.g. 'fusion-threshold-mb: 32'), top level or in a "
                        "section such as elastic:; flags given on the command line win")
    p.add_argument("--verbose", action="store_true", help="report each launch step")
    p.add_argument("--disable-cache", action="store_true", help=_no_op("--disable-cache"))

    h = p.add_argument_group("host arguments")
    hx = h.add_mutually_exclusive_group()
    hx.add_argument("-H", "--hosts", metavar="HOSTS",
                    help="[user@]host:slots list, e.g. localhost:2,node2:4 "
                         "(default: localhost:NP)")
    hx.add_argument("-hostfile", "--hostfile", metavar="FILE",
                    help="file with one 'host slots=N' per line (# comments allowed)")
    h.add_argument("--start-timeout", type=float, metavar="SECONDS",
                   help=f"bound on connecting to hosts, task registration and worker rendezvous "
                        f"(default: {cfg.START_TIMEOUT} or "
                        f"{' or '.join(cfg.horovod_twins(cfg.START_TIMEOUT))}, else "
                        f"{cfg.Config.start_timeout_s:.0f})")
    h.add_argument("--network-interfaces", "--network-interface", "--nics",
                   dest="network_interfaces", metavar="NICS",
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
    cx.add_argument("--jsrun", action="store_true", help=_refused("jsrun"))
    c.add_argument("--mpi-args", metavar="ARGS", help="extra arguments for mpiexec (one string)")
    c.add_argument("--binding-args", metavar="ARGS",
                   help="--mpi only: process binding arguments for mpiexec, replacing the "
                        "default (Open MPI: --bind-to none --map-by slot)")
    c.add_argument("--tcp", action="store_true", help=_no_op("--tcp"))
    mt = c.add_mutually_exclusive_group()
    mt.add_argument("--mpi-threads-disable", action="store_const", const=True,
                    help=_refused("mpi_threads_disable"))
    mt.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable",
                    action="store_const", const=False, help=_no_op("--no-mpi-threads-disable"))
    c.add_argument("--num-nccl-streams", type=int, metavar="N",
                   help=_refused("num_nccl_streams"))
    c.add_argument("--thread-affinity", type=int, metavar="CORE",
                   help=_refused("thread_affinity"))

    e = p.add_argument_group("environment")
    e.add_argument("-x", dest="env", action="append", default=None, metavar="NAME[=VALUE]",
                   help="also pass NAME (from this environment, or =VALUE) to every rank; "
                        "repeatable. Remote ranks get only HVDLITE_*, HOROVOD_*, PATH, "
                        "PYTHONPATH, LD_LIBRARY_PATH and these")

    o = p.add_argument_group("output")
    o.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.N/{stdout,stderr}")
    o.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp", action="store_true",
                   dest="prefix_output_with_timestamp",
                   help="put a timestamp before each output line's [rank] prefix")
    ts = o.add_mutually_exclusive_group()
    ts.add_argument("--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp",
                    action="store_const", const=False, help=_no_op("--log-without-timestamp"))
    ts.add_argument("--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp",
                    action="store_const", const=True, help=_refused("log_with_timestamp"))
    o.add_argument("--log-level", type=str.upper, choices=cfg.LOG_LEVEL_NAMES,
                   help="log level of the launcher and the workers (TRACE is DEBUG, FATAL is "
                        "CRITICAL)")

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
    t.add_argument("--gloo-timeout-seconds", type=float, metavar="SECONDS",
                   help="horovodrun's name for --op-timeout-seconds")
    sm = t.add_mutually_exclusive_group()
    sm.add_argument("--shared-memory", dest="shared_memory", action="store_const", const=True,
                    help="ranks on one host exchange through shared memory, hierarchically "
                         "across hosts (the default, Gloo mode)")
    sm.add_argument("--no-shared-memory", dest="shared_memory", action="store_const",
                    const=False, help="ranks on one host exchange through Gloo's TCP loopback")
    gf = t.add_mutually_exclusive_group()
    gf.add_argument("--gc-freeze", dest="gc_freeze", action="store_const", const=True,
                    help="at init, put the objects alive then out of the garbage collector's "
                         "reach, so its full passes stay short (the default)")
    gf.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_const", const=False,
                    help="leave Python's garbage collector as it is")
    for kind in ("allreduce", "allgather"):
        hg = t.add_mutually_exclusive_group()
        hg.add_argument(f"--hierarchical-{kind}", action="store_const", const=True,
                        help=f"horovodrun's flag: {kind} within a host through shared memory, "
                             f"then across hosts (hvdlite's default in Gloo mode)")
        hg.add_argument(f"--no-hierarchical-{kind}", dest=f"hierarchical_{kind}",
                        action="store_const", const=False,
                        help=_no_op(f"--no-hierarchical-{kind}"))

    tl = p.add_argument_group("timeline parameters", "rank 0 writes a Chrome-trace JSON "
                              "(open it in Perfetto or chrome://tracing; summarise it with "
                              "'python -m hvdlite.timeline summary FILE')")
    tl.add_argument("--timeline-filename", metavar="FILE",
                    help="write the timeline of every tensor's phases to FILE (on rank 0)")
    tlc = tl.add_mutually_exclusive_group()
    tlc.add_argument("--timeline-mark-cycles", action="store_const", const=True,
                     help="also mark each background-loop cycle in the timeline")
    tlc.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles",
                     action="store_const", const=False, help="do not mark cycles (the default)")

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
                    help=f"how long to wait for --min-np slots before failing (default: "
                         f"{' or '.join(cfg.horovod_twins(cfg.ELASTIC_TIMEOUT))}, else "
                         f"{DEFAULT_ELASTIC_TIMEOUT_S:.0f})")
    el.add_argument("--reset-limit", type=int, metavar="N",
                    help="fail once the job would need more than N resets (default: no limit)")
    el.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                    help="a failed host rejoins after a cooldown drawn from [MIN, MAX] seconds "
                         "(default: it stays out)")

    st = p.add_argument_group("stall check parameters")
    sx = st.add_mutually_exclusive_group()
    sx.add_argument("--no-stall-check", action="store_const", const=True,
                    help="disable the stall check")
    sx.add_argument("--stall-check", dest="no_stall_check", action="store_const", const=False,
                    help="keep the stall check on (the default)")
    st.add_argument("--stall-check-warning-time-seconds", type=float, metavar="SECONDS")
    st.add_argument("--stall-check-shutdown-time-seconds", type=float, metavar="SECONDS")

    at = p.add_argument_group("autotune parameters", "rank 0 searches the fusion threshold, "
                              "cycle time, in-place threshold, chunk size and response-cache "
                              "use by Bayesian optimisation during the first steps, then keeps "
                              "the best; every rank switches in the same cycle")
    ax = at.add_mutually_exclusive_group()
    ax.add_argument("--autotune", action="store_const", const=True,
                    help="tune the live parameters while the job runs")
    ax.add_argument("--no-autotune", dest="autotune", action="store_const", const=False,
                    help="keep the parameters as given (the default)")
    at.add_argument("--autotune-log-file", metavar="FILE",
                    help="write every sample (parameters, score in bytes/s) as CSV to FILE")
    at.add_argument("--autotune-warmup-samples", type=int, metavar="N",
                    help="samples discarded before the search starts (default 3)")
    at.add_argument("--autotune-steps-per-sample", type=int, metavar="N",
                    help="training steps measured per sample (default 10)")
    at.add_argument("--autotune-bayes-opt-max-samples", type=int, metavar="N",
                    help="samples of the Bayesian optimisation before it keeps the best "
                         "(default 20)")
    at.add_argument("--autotune-gaussian-process-noise", type=float, metavar="X",
                    help="noise (alpha) of the Gaussian process on normalised scores "
                         "(default 0.8)")

    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training command: 'python train.py ...' or 'train.py ...'")
    return p
