"""Every tunable of hvdlite, described once, as data.

One row per setting: its ``Config`` field, type, default, range, ``HVDLITE_*``
variable, Horovod twins, launcher flags, horovodrun YAML keys and help text.
``config.Config`` (fields, defaults, environment reading, range checks), the
launcher's tunable flags, its ``--config-file`` reader and docs/reference.md's table
are all built from :data:`TUNABLES`, so none of them can drift from the others.

``python -m hvdlite.common.config.tunables --markdown`` prints docs/reference.md's table.
"""

import dataclasses
import sys
from typing import Any, Callable, Dict, Optional, Tuple, Union

from hvdlite.common.config.log_levels import LOG_LEVEL_NAMES

#: the int32 control vector carries byte counts and the cycle time in microseconds
INT32_MAX = 2**31 - 1
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed values of a number: ``low`` (excluded when ``low_open``) to ``high``
    (``None``: unbounded), and the rule in words for messages."""

    low: float
    high: Optional[float]
    words: str
    low_open: bool = False

    def allows(self, value) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and (self.high is None or value <= self.high)


@dataclasses.dataclass(frozen=True)
class Option:
    """A flag that takes a value; the variable gets ``value * scale`` (e.g. MiB -> bytes,
    then at least ``at_least``).  ``names[0]`` gives the dest; ``help`` "" takes the
    tunable's."""

    names: Tuple[str, ...]
    metavar: Optional[str] = None
    type: Optional[Callable[[str], Any]] = None  # None: the tunable's type
    scale: int = 1
    at_least: Optional[int] = None
    choices: Optional[Tuple[str, ...]] = None
    help: str = ""

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")

    def to_env(self, value) -> Optional[str]:
        """The variable's text for the parsed flag value."""
        if self.scale == 1:
            return str(value)
        scaled = int(float(value) * self.scale)
        return str(scaled if self.at_least is None else max(self.at_least, scaled))


@dataclasses.dataclass(frozen=True)
class Switch:
    """Two flags that exclude each other: ``on`` stores True in the dest (from ``on[0]``),
    ``off`` stores False.  The variable gets "1" / "0"; with ``off_is_default_only``, the
    ``off`` flag only names horovodrun's default and sets nothing."""

    on: Tuple[str, ...]
    off: Tuple[str, ...]
    on_help: str
    off_help: str
    off_is_default_only: bool = False

    @property
    def dest(self) -> str:
        return self.on[0].lstrip("-").replace("-", "_")

    def to_env(self, value) -> Optional[str]:
        if value:
            return "1"
        return None if self.off_is_default_only else "0"


Flag = Union[Option, Switch]


@dataclasses.dataclass(frozen=True)
class YamlKey:
    """A key of horovodrun's config file (``section: {key: value}``) and the flag dest it
    sets; ``negate``: the key says the opposite of the flag (``stall_check.enabled``)."""

    section: str
    key: str
    dest: str
    negate: bool = False


@dataclasses.dataclass(frozen=True)
class Tunable:
    """One setting, everything about it.

    ``env_means_off``: the variable's true value turns the field off (``*_DISABLE``).
    ``choices`` / ``choices_words``: the allowed texts of a string setting.
    ``launcher_reads_env``: the launcher itself honours the variables (its default).
    ``readme_flags`` / ``shown_default``: the cells of docs/reference.md's table when the
    flags or the default do not say it by themselves.
    """

    field: str
    type: type
    default: Any
    env: str
    help: str
    unit: str = ""
    horovod: Tuple[str, ...] = ()
    range: Optional[Range] = None
    choices: Tuple[str, ...] = ()
    choices_words: str = ""
    env_means_off: bool = False
    flags: Tuple[Flag, ...] = ()
    group: str = "tunable parameters"
    yaml: Tuple[YamlKey, ...] = ()
    launcher_reads_env: bool = False
    readme_flags: str = ""
    shown_default: str = ""
    note: str = ""


_S = "seconds"
_POSITIVE_S = Range(1e-3, 1e7, "0.001..10000000 seconds (10000000 s is about 115 days)")
_NO_OP_HIERARCHICAL = (
    "Horovod's default; hvdlite's ranks on one host still share memory "
    "(turn that off with --no-shared-memory)"
)


def _hierarchical(kind: str) -> Switch:
    return Switch(
        (f"--hierarchical-{kind}",),
        (f"--no-hierarchical-{kind}",),
        f"horovodrun's flag: {kind} within a host through shared memory, then "
        f"across hosts (hvdlite's default in Gloo mode)",
        _NO_OP_HIERARCHICAL,
        off_is_default_only=True,
    )


#: every tunable, in the order of docs/reference.md's table
TUNABLES: Tuple[Tunable, ...] = (
    Tunable(
        "fusion_threshold_bytes",
        int,
        128 * MIB,
        "HVDLITE_FUSION_THRESHOLD",
        "largest fused allreduce buffer",
        unit="bytes",
        horovod=("HOROVOD_FUSION_THRESHOLD",),
        range=Range(0, INT32_MAX, f"0..{INT32_MAX} bytes (0 turns fusion off)"),
        flags=(
            Option(
                ("--fusion-threshold-mb",),
                "MB",
                float,
                MIB,
                help="fusion buffer size in MiB (0: off)",
            ),
        ),
        yaml=(YamlKey("params", "fusion_threshold_mb", "fusion_threshold_mb"),),
        note="0 = no fusion",
    ),
    Tunable(
        "cycle_time_ms",
        float,
        1.0,
        "HVDLITE_CYCLE_TIME",
        "how long the background loop gathers a burst of submissions before negotiating "
        "them (a synchronize ends it at once), and its gap after a cycle with nothing new",
        unit="ms",
        horovod=("HOROVOD_CYCLE_TIME",),
        range=Range(0.0, INT32_MAX / 1000.0 - 1, f"0..{INT32_MAX // 1000} ms"),
        flags=(Option(("--cycle-time-ms",), "MS"),),
        yaml=(YamlKey("params", "cycle_time_ms", "cycle_time_ms"),),
    ),
    Tunable(
        "cache_capacity",
        int,
        1024,
        "HVDLITE_CACHE_CAPACITY",
        "response cache entries (0: off)",
        horovod=("HOROVOD_CACHE_CAPACITY",),
        range=Range(0, 1 << 20, f"0..{1 << 20} entries (0 turns the cache off)"),
        flags=(Option(("--cache-capacity",), "N"),),
        yaml=(YamlKey("params", "cache_capacity", "cache_capacity"),),
        note="0 = off",
    ),
    Tunable(
        "inplace_threshold_bytes",
        int,
        2 * MIB,
        "HVDLITE_INPLACE_THRESHOLD",
        "reduce fused tensors at least this big in place instead of copying them through "
        "the fusion buffer (0: always copy)",
        unit="bytes",
        range=Range(0, INT32_MAX, f"0..{INT32_MAX} bytes"),
        flags=(Option(("--inplace-threshold-mb",), "MB", float, MIB),),
        note="fused tensors this big are reduced where they lie, not copied; 0 = always copy",
    ),
    Tunable(
        "fusion_chunk_bytes",
        int,
        16 * MIB,
        "HVDLITE_FUSION_CHUNK_BYTES",
        "fused allreduces are pipelined (pack / reduce / unpack overlapped) in chunks this big",
        unit="bytes",
        range=Range(1, INT32_MAX, f"1..{INT32_MAX} bytes"),
        flags=(
            Option(
                ("--fusion-chunk-mb",),
                "MB",
                float,
                MIB,
                at_least=1,
                help="pipeline fused allreduces in chunks of this many MiB",
            ),
        ),
        note="pipelining of big fused buffers",
    ),
    Tunable(
        "gloo_threads",
        int,
        4,
        "HVDLITE_GLOO_THREADS",
        "Gloo worker threads: collectives in flight at once",
        range=Range(1, 1024, "1..1024 threads"),
        flags=(Option(("--gloo-threads",), "N"),),
        note="Gloo collectives in flight at once",
    ),
    Tunable(
        "op_timeout_s",
        float,
        60.0,
        "HVDLITE_OP_TIMEOUT_SECONDS",
        "how long a collective may wait on a silent peer before failing",
        unit="s",
        horovod=("HOROVOD_GLOO_TIMEOUT_SECONDS",),
        range=_POSITIVE_S,
        flags=(
            Option(("--op-timeout-seconds",), "SECONDS"),
            Option(
                ("--gloo-timeout-seconds",),
                "SECONDS",
                help="horovodrun's name for --op-timeout-seconds",
            ),
        ),
        yaml=(YamlKey("library_options", "gloo_timeout_seconds", "gloo_timeout_seconds"),),
        note="a silent peer counts as failed after this",
    ),
    Tunable(
        "cpu_operations",
        str,
        "",
        "HVDLITE_CPU_OPERATIONS",
        'the collectives\' transport: Gloo or MPI ("" picks MPI under mpiexec, else Gloo)',
        horovod=("HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER"),
        choices=("", "gloo", "mpi", "local"),
        choices_words="'gloo' or 'mpi'",
        readme_flags="`--gloo` / `--mpi`",
        shown_default="auto",
        note="`gloo` / `mpi`; default: MPI under mpiexec, else Gloo",
    ),
    Tunable(
        "start_timeout_s",
        float,
        30.0,
        "HVDLITE_START_TIMEOUT",
        "bound on connecting to hosts, task registration and worker rendezvous",
        unit="s",
        horovod=("HOROVOD_START_TIMEOUT",),
        range=_POSITIVE_S,
        flags=(Option(("--start-timeout",), "SECONDS"),),
        group="host arguments",
        launcher_reads_env=True,
        note="also the launcher's default",
    ),
    Tunable(
        "max_workers",
        int,
        1024,
        "HVDLITE_MAX_WORKERS",
        "the most worker processes one job may run: -np, --min-np, --max-np (and the "
        "sizes given to RayExecutor and hvdlite.spark) and a discovered host's slots above "
        "it are refused before anything is placed, and an "
        "elastic job without --max-np grows to it at most (a guard against a typo such as "
        "-np 10000)",
        range=Range(1, 1 << 20, f"1..{1 << 20} processes"),
        group="host arguments",
        flags=(Option(("--max-workers",), "N"),),
        launcher_reads_env=True,
        note="the launcher's ceiling on the job's processes; raise it for a bigger job",
    ),
    Tunable(
        "elastic_timeout_s",
        float,
        600.0,
        "HVDLITE_ELASTIC_TIMEOUT",
        "elastic jobs: how long to wait for --min-np slots (and a worker for its next "
        "rendezvous round) before failing",
        unit="s",
        horovod=("HOROVOD_ELASTIC_TIMEOUT",),
        range=_POSITIVE_S,
        flags=(
            Option(
                ("--elastic-timeout",),
                "SECONDS",
                help="how long to wait for --min-np slots before failing",
            ),
        ),
        group="elastic arguments",
        launcher_reads_env=True,
        readme_flags="`--elastic-timeout` (elastic jobs)",
        note="the launcher's wait for slots, and each worker's for its next round",
    ),
    Tunable(
        "discovery_settle_s",
        float,
        5.0,
        "HVDLITE_DISCOVERY_SETTLE_SECONDS",
        "elastic jobs with --host-discovery-script: a host that appears (new, back after it "
        "was dropped, or with more slots) is used only once discovery has listed it this "
        "long without a break, so a flapping host does not reset the job each time it "
        "comes back; a dropped host leaves at once, and the first answer is used as is "
        "(0: use every answer at once)",
        unit="s",
        range=Range(0.0, 1e7, "0..10000000 seconds (0: no damping)"),
        flags=(Option(("--discovery-settle-seconds",), "SECONDS"),),
        group="elastic arguments",
        launcher_reads_env=True,
        readme_flags="`--discovery-settle-seconds` (elastic jobs)",
        note="the launcher's: a host that appears or comes back in discovery is used once "
        "listed this long; 0 = at once",
    ),
    Tunable(
        "timeline_filename",
        str,
        "",
        "HVDLITE_TIMELINE",
        "write the timeline of every tensor's phases to FILE (on rank 0)",
        horovod=("HOROVOD_TIMELINE",),
        group="timeline parameters",
        flags=(Option(("--timeline-filename",), "FILE"),),
        yaml=(YamlKey("timeline", "filename", "timeline_filename"),),
        shown_default="off",
        note="rank 0 writes a Chrome trace there",
    ),
    Tunable(
        "timeline_mark_cycles",
        bool,
        False,
        "HVDLITE_TIMELINE_MARK_CYCLES",
        "also mark each background-loop cycle in the timeline",
        horovod=("HOROVOD_TIMELINE_MARK_CYCLES",),
        group="timeline parameters",
        flags=(
            Switch(
                ("--timeline-mark-cycles",),
                ("--no-timeline-mark-cycles",),
                "also mark each background-loop cycle in the timeline",
                "do not mark cycles",
            ),
        ),
        yaml=(YamlKey("timeline", "mark_cycles", "timeline_mark_cycles"),),
    ),
    Tunable(
        "timeline_max_bytes",
        int,
        0,
        "HVDLITE_TIMELINE_MAX_BYTES",
        "keep the timeline on disk to about this many bytes: the file is rotated "
        "(FILE, FILE.1, ... FILE.3, each a complete trace) and the oldest is dropped "
        "(0: one file, unbounded)",
        unit="bytes",
        group="timeline parameters",
        range=Range(0, 1 << 50, f"0..{1 << 50} bytes (1 PiB; 0: unbounded)"),
        flags=(
            Option(
                ("--timeline-max-mb",),
                "MB",
                float,
                MIB,
                help="keep the timeline to about this many MiB on disk, in rotated "
                "files FILE, FILE.1, ... (0: unbounded)",
            ),
        ),
        shown_default="unbounded",
        note="rotation: FILE, FILE.1 .. FILE.3, each a complete trace",
    ),
    Tunable(
        "autotune",
        bool,
        False,
        "HVDLITE_AUTOTUNE",
        "rank 0 searches the live parameters (Bayesian optimisation) during the first steps",
        horovod=("HOROVOD_AUTOTUNE",),
        group="autotune parameters",
        flags=(
            Switch(
                ("--autotune",),
                ("--no-autotune",),
                "tune the live parameters while the job runs",
                "keep the parameters as given",
            ),
        ),
        yaml=(YamlKey("autotune", "enabled", "autotune"),),
    ),
    Tunable(
        "autotune_log_file",
        str,
        "",
        "HVDLITE_AUTOTUNE_LOG",
        "write every sample (parameters, score in bytes/s) as CSV to FILE",
        horovod=("HOROVOD_AUTOTUNE_LOG",),
        group="autotune parameters",
        flags=(Option(("--autotune-log-file",), "FILE"),),
        yaml=(YamlKey("autotune", "log_file", "autotune_log_file"),),
        shown_default="none",
        note="CSV of every sample",
    ),
    Tunable(
        "autotune_warmup_samples",
        int,
        3,
        "HVDLITE_AUTOTUNE_WARMUP_SAMPLES",
        "samples discarded before the search starts",
        horovod=("HOROVOD_AUTOTUNE_WARMUP_SAMPLES",),
        group="autotune parameters",
        range=Range(0, None, ">= 0 samples"),
        flags=(Option(("--autotune-warmup-samples",), "N"),),
        yaml=(YamlKey("autotune", "warmup_samples", "autotune_warmup_samples"),),
    ),
    Tunable(
        "autotune_steps_per_sample",
        int,
        10,
        "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE",
        "training steps measured per sample (a repeat of a tensor name ends a step)",
        horovod=("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",),
        group="autotune parameters",
        range=Range(1, None, ">= 1 steps"),
        flags=(Option(("--autotune-steps-per-sample",), "N"),),
        yaml=(YamlKey("autotune", "steps_per_sample", "autotune_steps_per_sample"),),
    ),
    Tunable(
        "autotune_bayes_opt_max_samples",
        int,
        20,
        "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        "samples of the Bayesian optimisation before it keeps the best",
        horovod=("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",),
        group="autotune parameters",
        range=Range(1, None, ">= 1 samples"),
        flags=(Option(("--autotune-bayes-opt-max-samples",), "N"),),
        yaml=(YamlKey("autotune", "bayes_opt_max_samples", "autotune_bayes_opt_max_samples"),),
    ),
    Tunable(
        "autotune_gaussian_process_noise",
        float,
        0.8,
        "HVDLITE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        "noise (alpha) of the Gaussian process on normalised scores",
        horovod=("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",),
        group="autotune parameters",
        range=Range(0.0, None, "> 0", low_open=True),
        flags=(Option(("--autotune-gaussian-process-noise",), "X"),),
        yaml=(YamlKey("autotune", "gaussian_process_noise", "autotune_gaussian_process_noise"),),
    ),
    Tunable(
        "stall_check",
        bool,
        True,
        "HVDLITE_STALL_CHECK_DISABLE",
        "rank 0 watches for tensors that some ranks submitted and others did not",
        horovod=("HOROVOD_STALL_CHECK_DISABLE",),
        env_means_off=True,
        group="stall check parameters",
        flags=(
            Switch(
                ("--no-stall-check",),
                ("--stall-check",),
                "disable the stall check",
                "keep the stall check on",
            ),
        ),
        yaml=(YamlKey("stall_check", "enabled", "no_stall_check", negate=True),),
        shown_default="check on",
        note="1 = no stall check",
    ),
    Tunable(
        "stall_check_warning_time_s",
        float,
        60.0,
        "HVDLITE_STALL_CHECK_TIME_SECONDS",
        "rank 0 warns, naming the missing ranks, when a tensor some ranks submitted has "
        "waited this long for the others",
        unit="s",
        horovod=("HOROVOD_STALL_CHECK_TIME_SECONDS",),
        group="stall check parameters",
        range=Range(0.0, 1e7, "0..10000000 seconds"),
        flags=(Option(("--stall-check-warning-time-seconds",), "SECONDS"),),
        yaml=(YamlKey("stall_check", "warning_time_seconds", "stall_check_warning_time_seconds"),),
    ),
    Tunable(
        "stall_check_shutdown_time_s",
        float,
        0.0,
        "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS",
        "fail the job when such a tensor has waited this long (0: only warn)",
        unit="s",
        horovod=("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",),
        group="stall check parameters",
        range=Range(0.0, 1e7, "0..10000000 seconds (0: never shut down)"),
        flags=(Option(("--stall-check-shutdown-time-seconds",), "SECONDS"),),
        yaml=(
            YamlKey("stall_check", "shutdown_time_seconds", "stall_check_shutdown_time_seconds"),
        ),
        note="0 = only warn",
    ),
    Tunable(
        "straggler_window_s",
        float,
        60.0,
        "HVDLITE_STRAGGLER_WINDOW_SECONDS",
        "rank 0 warns, naming the rank, when one rank was the last to be ready in more than "
        "half of the completing cycles of such a window and kept the others waiting more "
        "than a tenth of it",
        unit="s",
        range=_POSITIVE_S,
        group="monitoring",
        flags=(Option(("--straggler-window-seconds",), "SECONDS"),),
        note="the straggler report's window",
    ),
    Tunable(
        "metrics_port",
        int,
        0,
        "HVDLITE_METRICS_PORT",
        "hvdlite-run serves Prometheus metrics of every rank at http://ADDRESS:PORT/metrics "
        "(0: off); the ranks then send it their counters every second",
        range=Range(0, 65535, "0..65535 (0: off)"),
        group="monitoring",
        flags=(Option(("--metrics-port",), "PORT"),),
        launcher_reads_env=True,
        shown_default="off",
        note="0 = off; Gloo jobs",
    ),
    Tunable(
        "metrics_address",
        str,
        "127.0.0.1",
        "HVDLITE_METRICS_ADDRESS",
        "the address the metrics endpoint listens on (unauthenticated and read-only: "
        "0.0.0.0 opens it to the network)",
        group="monitoring",
        flags=(Option(("--metrics-address",), "ADDRESS"),),
        launcher_reads_env=True,
        note="loopback by default",
    ),
    Tunable(
        "log_level",
        str,
        "WARNING",
        "HVDLITE_LOG_LEVEL",
        "log level of the launcher and the workers (TRACE is DEBUG, FATAL is CRITICAL)",
        horovod=("HOROVOD_LOG_LEVEL",),
        group="output",
        flags=(Option(("--log-level",), type=str.upper, choices=LOG_LEVEL_NAMES),),
        yaml=(YamlKey("logging", "level", "log_level"),),
        note="Horovod's TRACE is DEBUG, FATAL is CRITICAL",
    ),
    Tunable(
        "flight_recorder_size",
        int,
        1000,
        "HVDLITE_FLIGHT_RECORDER_SIZE",
        "each rank keeps its last N operations in memory and writes them to a file when the "
        "job fails or stalls past the shutdown time (0: off)",
        group="output",
        range=Range(0, 10_000_000, "0..10000000 operations (0: off)"),
        flags=(Option(("--flight-recorder-size",), "N"),),
        note="0 = off; read the dumps with `hvdlite-doctor`",
    ),
    Tunable(
        "flight_recorder_dir",
        str,
        "",
        "HVDLITE_FLIGHT_RECORDER_DIR",
        "where each rank writes its flight-recorder dump (flight-rank<R>.json)",
        group="output",
        flags=(Option(("--flight-recorder-dir",), "DIR"),),
        shown_default="<tempdir>/hvdlite-flight-<job id>",
        note="on each rank's host",
    ),
    Tunable(
        "fault_at",
        str,
        "",
        "HVDLITE_FAULT_AT",
        "testing elastic scripts: the process that is rank R fails after its N-th "
        "state.commit() (rank=R,commit=N[,action=exit|kill|hang|raise][,exit_code=C]"
        "[,round=K]; see hvdlite.testing)",
        group="output",
        flags=(Option(("--fault-at",), "SPEC"),),
        shown_default="off",
        note="fault injection for tests of elastic scripts",
    ),
    Tunable(
        "shared_memory",
        bool,
        True,
        "HVDLITE_SHARED_MEMORY",
        "ranks on one host exchange through a shared segment, hierarchically across hosts "
        "(Gloo mode)",
        # the hierarchical flags come first: an explicit --no-shared-memory wins over them
        flags=(
            _hierarchical("allreduce"),
            _hierarchical("allgather"),
            Switch(
                ("--shared-memory",),
                ("--no-shared-memory",),
                "ranks on one host exchange through shared memory, hierarchically "
                "across hosts (Gloo mode)",
                "ranks on one host exchange through Gloo's TCP loopback",
            ),
        ),
        note="ranks on one host exchange through a shared segment, hierarchically across "
        "hosts; Gloo mode",
        yaml=(
            YamlKey("params", "hierarchical_allreduce", "hierarchical_allreduce"),
            YamlKey("params", "hierarchical_allgather", "hierarchical_allgather"),
        ),
        readme_flags="`--no-shared-memory` / `--shared-memory` (horovodrun's "
        "`--hierarchical-allreduce`, `--hierarchical-allgather` ask for it)",
    ),
    Tunable(
        "zero_copy",
        bool,
        True,
        "HVDLITE_ZERO_COPY",
        "DistributedOptimizer's gradient buckets live in memory the host's other ranks "
        "map, so shared-memory allreduces read and write them where they lie",
        flags=(
            Switch(
                ("--zero-copy",),
                ("--no-zero-copy",),
                "allocate gradient buckets where the host's other ranks can read "
                "them (shared memory only): no copy in or out",
                "keep gradient buckets in each rank's private memory",
            ),
        ),
        readme_flags="`--no-zero-copy` / `--zero-copy`",
        note="Gloo mode with shared memory; buckets without compression, in the global "
        "set; anything else takes the copying path",
    ),
    Tunable(
        "gc_freeze",
        bool,
        True,
        "HVDLITE_GC_FREEZE",
        "init() moves every object alive then out of the garbage collector's reach",
        flags=(
            Switch(
                ("--gc-freeze",),
                ("--no-gc-freeze",),
                "at init, put the objects alive then out of the garbage collector's "
                "reach, so its full passes stay short",
                "leave Python's garbage collector as it is",
            ),
        ),
        readme_flags="`--no-gc-freeze` / `--gc-freeze`",
        note="`init()` calls `gc.freeze()`: the objects alive then, ~170,000 with torch, are "
        "left out of the garbage collector's full passes, which a step of many small ops "
        "triggers every few steps; 1000 allreduces of 1 KiB at np=2: mean step "
        "20–27 ms → 8–11 ms",
    ),
    Tunable(
        "tf_async_kernel",
        bool,
        True,
        "HVDLITE_TF_ASYNC_KERNEL",
        "a TF1 graph's collectives are hvdlite's asynchronous TensorFlow kernel (compiled "
        "on first use), not tf.data pipelines",
        flags=(
            Switch(
                ("--tf-async-kernel",),
                ("--no-tf-async-kernel",),
                "run a TF1 graph's collectives as hvdlite's asynchronous kernel "
                "(compiled with g++ on first use, cached in ~/.cache/hvdlite)",
                "run a TF1 graph's collectives as tf.data pipelines (no compiler "
                "needed; each new fetch of a large graph is slower)",
            ),
        ),
        readme_flags="`--no-tf-async-kernel` / `--tf-async-kernel`",
        note="one node per collective that holds no inter-op thread while it waits, as "
        "Horovod's C++ ops; where it cannot be built, the pipelines, said once in the "
        "log",
    ),
    Tunable(
        "torch_env",
        bool,
        True,
        "HVDLITE_TORCH_ENV",
        "the ranks of a static Gloo job also get torchrun's variables (RANK, WORLD_SIZE, "
        "LOCAL_RANK, MASTER_ADDR, ...), so a torch.distributed program runs unchanged",
        flags=(
            Switch(
                ("--torch-env",),
                ("--no-torch-env",),
                "give the ranks torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, "
                "MASTER_ADDR, MASTER_PORT, ...)",
                "leave RANK, WORLD_SIZE, MASTER_ADDR & co as they are (you set them yourself)",
            ),
        ),
        group="environment",
        launcher_reads_env=True,
        readme_flags="`--no-torch-env` / `--torch-env`",
        note="a DDP, FSDP, Lightning or Hugging Face program's `init_process_group()` "
        "(env://) works unchanged, the launcher serving torch's store on `MASTER_PORT` "
        "once a rank connects; static Gloo jobs started by hvdlite-run or hvdlite.run",
    ),
    Tunable(
        "allow_other_interpreter",
        bool,
        False,
        "HVDLITE_ALLOW_OTHER_INTERPRETER",
        "start a command whose Python (another file than hvdlite-run's own) cannot import "
        "hvdlite or torch while hvdlite-run's can; otherwise it is refused before anything "
        "starts",
        flags=(
            Switch(
                ("--allow-other-interpreter",),
                ("--check-interpreter",),
                "start the command even when its Python lacks hvdlite or torch (a "
                "program that needs neither, or hosts whose Python differs)",
                "refuse a command whose Python lacks hvdlite or torch (the default)",
            ),
        ),
        group="environment",
        launcher_reads_env=True,
        readme_flags="`--allow-other-interpreter` / `--check-interpreter`",
        note="checked on this host; a job on remote hosts only is warned about, not refused",
    ),
    Tunable(
        "merge_rank_output",
        bool,
        True,
        "HVDLITE_MERGE_RANK_OUTPUT",
        "a stderr line that several ranks of a static job print within 0.3 s is printed "
        "once, tagged with their ranks ([0-3]<stderr>:)",
        group="output",
        launcher_reads_env=True,
        flags=(
            Switch(
                ("--merge-rank-output",),
                ("--no-merge-rank-output",),
                "print a stderr line that several ranks print once, as [0-3]<stderr>: "
                "(the default)",
                "print every rank's stderr lines as they are, [rank]<stderr>:",
            ),
        ),
        readme_flags="`--no-merge-rank-output` / `--merge-rank-output`",
        note="stderr only (stdout stays per rank, and --output-filename's files are per "
        "rank); not under --mpi or in elastic jobs",
    ),
    Tunable(
        "dynamic_process_sets",
        bool,
        False,
        "HVDLITE_DYNAMIC_PROCESS_SETS",
        "process sets may be added and removed after init (hvd.add_process_set)",
        horovod=("HOROVOD_DYNAMIC_PROCESS_SETS",),
        readme_flags="(no flag)",
        note="1 = `add_process_set` allowed",
    ),
)

#: Config field -> its row
BY_FIELD: Dict[str, Tunable] = {t.field: t for t in TUNABLES}


def flag_variables() -> Dict[str, Tuple[str, Callable[[Any], Optional[str]]]]:
    """flag dest -> (variable, parsed value -> the variable's text or None), in table
    order (a later dest wins when two set one variable)."""
    return {f.dest: (t.env, f.to_env) for t in TUNABLES for f in t.flags}


def _number(value: float) -> str:
    return f"{value:g}"


def shown_default(t: Tunable) -> str:
    """The default as a reader wants it: units, on/off."""
    if t.shown_default:
        return t.shown_default
    if t.type is bool:
        return "on" if t.default else "off"
    if t.unit == "bytes":
        return f"{_number(t.default / MIB)} MiB"
    if t.unit in ("ms", "s"):
        return f"{_number(t.default)} {t.unit}"
    return str(t.default)


def flag_default(t: Tunable, flag: Option) -> str:
    """The default in the flag's own units, for ``--help``."""
    if t.type is str:
        value = t.default or "none"
    else:
        value = _number(t.default / flag.scale)
    if t.launcher_reads_env:
        return f"{' or '.join((t.env,) + t.horovod)}, else {value}"
    return value


def switch_default(t: Tunable, switch: Switch) -> str:
    """The flag of ``switch`` that names what happens when neither is given."""
    if switch.off_is_default_only:
        return switch.off[0]
    return switch.on[0] if t.default != t.env_means_off else switch.off[0]


def _flags_cell(t: Tunable) -> str:
    if t.readme_flags:
        return t.readme_flags
    cells = []
    for f in t.flags:
        if isinstance(f, Switch):
            cells.append(" / ".join(f"`{n}`" for n in f.on + f.off))
        else:
            cells.append(", ".join(f"`{n}`" for n in f.names))
    return ", ".join(cells)


def _variable_cell(t: Tunable) -> str:
    notes = []
    if t.horovod:
        notes.append(", then ".join(f"`{h}`" for h in t.horovod))
    if t.unit in ("bytes", "ms"):
        notes.append(t.unit)
    if t.note:
        notes.append(t.note)
    return f"`{t.env}`" + (f" ({'; '.join(notes)})" if notes else "")


def markdown() -> str:
    """docs/reference.md's table of tunables (flag, variable with its Horovod twin, default)."""
    lines = ["| flag | variable (Horovod's twin) | default |", "|---|---|---|"]
    lines += [f"| {_flags_cell(t)} | {_variable_cell(t)} | {shown_default(t)} |" for t in TUNABLES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m hvdlite.common.config.tunables --markdown")
    sys.stdout.write(markdown())
