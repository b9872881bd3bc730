"""One frozen object holding every tunable and every launcher-provided fact.

Each ``HVDLITE_*`` name is spelled exactly once, here, and so is each
``HOROVOD_*`` name hvdlite reads.  The launcher turns its flags into these
variables (``runner`` imports the names from this module), and ``init()`` reads
them once with :meth:`Config.from_env`.

Horovod users keep their environment: Horovod's tuning variables are read as
fallbacks of ours (an ``HVDLITE_*`` value wins over its ``HOROVOD_*`` twin), and
the ``HOROVOD_*`` variables that mean nothing here are named in one warning,
each with the reason, instead of being silently dropped.
"""

import dataclasses
import logging
import math
import os
from typing import Dict, List, Mapping, Optional, Set, Tuple

from .exceptions import HvdliteConfigError

log = logging.getLogger(__name__)

PREFIX = "HVDLITE_"

# --- identity of this process inside the job (set by the launcher per rank) ---
RANK = "HVDLITE_RANK"
SIZE = "HVDLITE_SIZE"
LOCAL_RANK = "HVDLITE_LOCAL_RANK"
LOCAL_SIZE = "HVDLITE_LOCAL_SIZE"
CROSS_RANK = "HVDLITE_CROSS_RANK"
CROSS_SIZE = "HVDLITE_CROSS_SIZE"
HOSTNAME = "HVDLITE_HOSTNAME"

# --- rendezvous (set by the launcher for the whole job) ---
RENDEZVOUS_ADDR = "HVDLITE_RENDEZVOUS_ADDR"
RENDEZVOUS_PORT = "HVDLITE_RENDEZVOUS_PORT"
SECRET_KEY = "HVDLITE_SECRET_KEY"          # hex; never on a command line
JOB_ID = "HVDLITE_JOB_ID"
GLOO_IFACE = "HVDLITE_GLOO_IFACE"
GLOO_THREADS = "HVDLITE_GLOO_THREADS"
#: "1" when the elastic driver runs the job (rounds change membership while it runs)
ELASTIC = "HVDLITE_ELASTIC"
#: elastic mode: how long a worker waits for the driver to open its next round
ELASTIC_TIMEOUT = "HVDLITE_ELASTIC_TIMEOUT"

# --- tunables (each has a launcher flag) ---
CPU_OPERATIONS = "HVDLITE_CPU_OPERATIONS"
FUSION_THRESHOLD = "HVDLITE_FUSION_THRESHOLD"
FUSION_CHUNK = "HVDLITE_FUSION_CHUNK_BYTES"
INPLACE_THRESHOLD = "HVDLITE_INPLACE_THRESHOLD"
CYCLE_TIME = "HVDLITE_CYCLE_TIME"
CACHE_CAPACITY = "HVDLITE_CACHE_CAPACITY"
OP_TIMEOUT = "HVDLITE_OP_TIMEOUT_SECONDS"
START_TIMEOUT = "HVDLITE_START_TIMEOUT"
STALL_CHECK_DISABLE = "HVDLITE_STALL_CHECK_DISABLE"
STALL_CHECK_WARNING_TIME = "HVDLITE_STALL_CHECK_TIME_SECONDS"
STALL_CHECK_SHUTDOWN_TIME = "HVDLITE_STALL_SHUTDOWN_TIME_SECONDS"
LOG_LEVEL = "HVDLITE_LOG_LEVEL"
#: "0": ranks on one host exchange through Gloo's TCP loopback instead of shared memory
SHARED_MEMORY = "HVDLITE_SHARED_MEMORY"
#: "0": leave Python's garbage collector as it is at init (see Config.gc_freeze)
GC_FREEZE = "HVDLITE_GC_FREEZE"
#: "1": process sets may be added and removed while the job runs (hvd.add_process_set)
DYNAMIC_PROCESS_SETS = "HVDLITE_DYNAMIC_PROCESS_SETS"
# --- timeline and autotuning (each has a launcher flag) ---
TIMELINE = "HVDLITE_TIMELINE"
TIMELINE_MARK_CYCLES = "HVDLITE_TIMELINE_MARK_CYCLES"
AUTOTUNE = "HVDLITE_AUTOTUNE"
AUTOTUNE_LOG = "HVDLITE_AUTOTUNE_LOG"
AUTOTUNE_WARMUP_SAMPLES = "HVDLITE_AUTOTUNE_WARMUP_SAMPLES"
AUTOTUNE_STEPS_PER_SAMPLE = "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE"
AUTOTUNE_BAYES_OPT_MAX_SAMPLES = "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES"
AUTOTUNE_GAUSSIAN_PROCESS_NOISE = "HVDLITE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE"

# --- hvdlite.run (set by ``hvdlite.run`` for the workers it starts) ---
#: hex key of the function service; travels like the job key, never on a command line
RUN_FUNC_KEY = "HVDLITE_RUN_FUNC_KEY"
RUN_FUNC_PORT = "HVDLITE_RUN_FUNC_PORT"
#: comma-separated addresses of the caller's host, tried in order
RUN_FUNC_ADDRS = "HVDLITE_RUN_FUNC_ADDRS"

# The variables horovodrun exports, which user scripts read; the launcher sets
# them to the same values as their HVDLITE_* twins.
HOROVOD_ALIASES: Dict[str, str] = {
    RANK: "HOROVOD_RANK",
    SIZE: "HOROVOD_SIZE",
    LOCAL_RANK: "HOROVOD_LOCAL_RANK",
    LOCAL_SIZE: "HOROVOD_LOCAL_SIZE",
    CROSS_RANK: "HOROVOD_CROSS_RANK",
    CROSS_SIZE: "HOROVOD_CROSS_SIZE",
    HOSTNAME: "HOROVOD_HOSTNAME",
}

_KNOWN = {v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str)
          and v.startswith(PREFIX)}

# --- Horovod's variables --------------------------------------------------------------------

HOROVOD_PREFIX = "HOROVOD_"

#: Horovod's runtime variables that set one of ours when ours is unset (Horovod's name ->
#: ours; several twins of one variable are tried in this order).  Units agree: the fusion
#: threshold is in bytes, the cycle time in ms, the timeouts in seconds.
HOROVOD_FALLBACKS: Dict[str, str] = {
    "HOROVOD_FUSION_THRESHOLD": FUSION_THRESHOLD,
    "HOROVOD_CYCLE_TIME": CYCLE_TIME,
    "HOROVOD_CACHE_CAPACITY": CACHE_CAPACITY,
    "HOROVOD_STALL_CHECK_DISABLE": STALL_CHECK_DISABLE,
    "HOROVOD_STALL_CHECK_TIME_SECONDS": STALL_CHECK_WARNING_TIME,
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": STALL_CHECK_SHUTDOWN_TIME,
    "HOROVOD_LOG_LEVEL": LOG_LEVEL,
    "HOROVOD_DYNAMIC_PROCESS_SETS": DYNAMIC_PROCESS_SETS,
    # Horovod bounds each Gloo operation by this; hvdlite's op timeout is the same bound
    "HOROVOD_GLOO_TIMEOUT_SECONDS": OP_TIMEOUT,
    # hvdlite has one choice (Gloo or MPI) where Horovod has two (operations, controller)
    "HOROVOD_CPU_OPERATIONS": CPU_OPERATIONS,
    "HOROVOD_CONTROLLER": CPU_OPERATIONS,
    "HOROVOD_START_TIMEOUT": START_TIMEOUT,
    "HOROVOD_ELASTIC_TIMEOUT": ELASTIC_TIMEOUT,
    "HOROVOD_TIMELINE": TIMELINE,
    "HOROVOD_TIMELINE_MARK_CYCLES": TIMELINE_MARK_CYCLES,
    "HOROVOD_AUTOTUNE": AUTOTUNE,
    "HOROVOD_AUTOTUNE_LOG": AUTOTUNE_LOG,
    "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": AUTOTUNE_WARMUP_SAMPLES,
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": AUTOTUNE_STEPS_PER_SAMPLE,
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": AUTOTUNE_BAYES_OPT_MAX_SAMPLES,
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": AUTOTUNE_GAUSSIAN_PROCESS_NOISE,
}
#: the values of Horovod's controller variables that hvdlite has (Horovod also knows CCL)
_HOROVOD_CONTROLLERS = ("gloo", "mpi")

#: when a no-effect variable is worth a warning: any value, a true one, or a false one
#: (a variable set to Horovod's default, e.g. HOROVOD_HIERARCHICAL_ALLREDUCE=0, asks for
#: nothing hvdlite lacks)
_ANY, _ON, _OFF = "any", "on", "off"
_FLAT = "hvdlite has no torus allreduce; its shared-memory path is already hierarchical"
_CPU_ONLY = "GPU only; hvdlite works on CPU tensors"

#: Horovod's runtime variables that change nothing in hvdlite: name -> (when, why).
HOROVOD_NO_EFFECT: Dict[str, Tuple[str, str]] = {
    "HOROVOD_TORUS_ALLREDUCE": (_ON, _FLAT),
    "HOROVOD_DISABLE_GROUP_FUSION": (
        _ON, "hvdlite fuses grouped tensors like any others; keeping groups apart is not "
             "implemented"),
    "HOROVOD_BATCH_D2D_MEMCOPIES": (_ANY, _CPU_ONLY),
    "HOROVOD_NUM_NCCL_STREAMS": (_ANY, "NCCL is GPU only; hvdlite has no NCCL"),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": (_ON, _CPU_ONLY),
    "HOROVOD_DISABLE_NVTX_RANGES": (_ON, _CPU_ONLY),
    "HOROVOD_ENABLE_XLA_OPS": (_ON, "TensorFlow only; hvdlite supports PyTorch"),
    "HOROVOD_CCL_CACHE": (_ANY, "oneCCL only; hvdlite runs Gloo or MPI"),
    "HOROVOD_MPI_THREADS_DISABLE": (
        _ON, "hvdlite calls MPI from its background thread, which needs MPI's thread support"),
    "HOROVOD_THREAD_AFFINITY": (
        _ANY, "hvdlite's background loop is a Python thread and is not pinned to a core"),
    "HOROVOD_GLOO_IFACE": (
        _ANY, "hvdlite-run picks the interface; choose it with --network-interfaces"),
    "HOROVOD_LOG_HIDE_TIME": (_OFF, "hvdlite's log lines carry no timestamp"),
}

#: ours -> its Horovod twins, in lookup order
_TWINS: Dict[str, Tuple[str, ...]] = {
    ours: tuple(h for h, o in HOROVOD_FALLBACKS.items() if o == ours)
    for ours in HOROVOD_FALLBACKS.values()}

#: what torchrun (and torch.distributed's other launchers) set in every process
TORCH_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: set in every process an MPI process manager starts (Hydra, Open MPI, PMIx, Intel MPI)
MPI_LAUNCH_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                        "MPI_LOCALRANKID")
#: the job size as MPI process managers publish it
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")

#: Horovod's log levels as Python's (Horovod has TRACE and FATAL)
_LOG_LEVEL_ALIASES = {"TRACE": "DEBUG", "FATAL": "CRITICAL", "WARN": "WARNING"}
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: every level name accepted, Horovod's included (the launcher's --log-level choices)
LOG_LEVEL_NAMES = ("TRACE",) + _LOG_LEVELS[:-1] + ("FATAL", "CRITICAL")

#: notes already logged by this process (``init()`` after ``shutdown()`` does not repeat them)
_WARNED: Set[str] = set()


def log_level_name(level: str) -> str:
    """Python's name of a log level given in Horovod's or Python's spelling, any case.

    Raises:
        HvdliteConfigError: not a level name (the message lists them).
    """
    name = str(level).strip().upper()
    name = _LOG_LEVEL_ALIASES.get(name, name)
    if name not in _LOG_LEVELS:
        raise HvdliteConfigError(
            f"log level {level!r} is not one of {', '.join(LOG_LEVEL_NAMES)}")
    return name


class HvdliteSettingError(HvdliteConfigError):
    """One setting is out of range; ``variable`` names it, so that the launcher can name
    the flag or file key it came from instead."""

    def __init__(self, variable: str, value, reason: str):
        super().__init__(f"{variable}={value!r}: {reason}")
        self.variable = variable
        self.value = value
        self.reason = reason


#: the int32 control vector carries byte counts and the cycle time in microseconds
INT32_MAX = 2 ** 31 - 1


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise HvdliteConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def _parse_number(name: str, raw: str, kind):
    try:
        return kind(raw)
    except ValueError:
        raise HvdliteConfigError(
            f"{name}={raw!r} is not a valid {kind.__name__}") from None


@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting of one process of a job; defaults follow Horovod's."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    hostname: str = "localhost"
    rendezvous_addr: Optional[str] = None
    rendezvous_port: Optional[int] = None
    secret_key: Optional[bytes] = dataclasses.field(default=None, repr=False)
    job_id: str = "job"
    #: the elastic driver runs this job: membership may change between rendezvous rounds
    elastic: bool = False
    #: elastic mode: bound on waiting for the next rendezvous round (--elastic-timeout)
    elastic_timeout_s: float = 600.0
    #: network interface Gloo binds to (the launcher picks one routable between all hosts)
    gloo_iface: str = ""
    #: Gloo worker threads: collectives in flight at once (more hides per-op latency when a
    #: fused group is sent as several pieces)
    gloo_threads: int = 4
    #: "" picks automatically: MPI under mpiexec, Gloo under hvdlite-run.
    cpu_operations: str = ""
    #: largest fused allreduce buffer; 0 turns fusion off.
    fusion_threshold_bytes: int = 128 * 1024 * 1024
    #: fused allreduces are pipelined (pack / reduce / unpack overlapped) in chunks this big.
    fusion_chunk_bytes: int = 16 * 1024 * 1024
    #: within a fused group, tensors at least this big are reduced where they lie instead of
    #: being copied through the fusion buffer (a copy costs more than their own collective);
    #: 0 packs everything, as Horovod does.
    inplace_threshold_bytes: int = 2 * 1024 * 1024
    #: period of the background loop.
    cycle_time_ms: float = 1.0
    #: response cache entries; 0 turns the cache off.
    cache_capacity: int = 1024
    #: bound on any single collective / control exchange before peers count as failed.
    op_timeout_s: float = 60.0
    #: bound on reaching the other ranks at init (and on the launcher's start-up steps).
    start_timeout_s: float = 30.0
    stall_check: bool = True
    stall_check_warning_time_s: float = 60.0
    #: 0 means never fail on a stall, only warn.
    stall_check_shutdown_time_s: float = 0.0
    log_level: str = "WARNING"
    #: ranks of one host exchange through a shared segment (hierarchical across hosts)
    shared_memory: bool = True
    #: init() moves every object alive then (modules, classes: torch's ~170,000) out of the
    #: garbage collector's reach (gc.freeze): a full collection, which the per-op objects of
    #: a busy step trigger every few steps, then costs ~1 ms instead of ~100
    gc_freeze: bool = True
    #: process sets may be added / removed after init (Horovod's dynamic process sets)
    dynamic_process_sets: bool = False
    #: rank 0 writes a Chrome-trace JSON of every tensor's phases here ("" = no timeline)
    timeline_filename: str = ""
    #: also mark each background-loop cycle in the timeline
    timeline_mark_cycles: bool = False
    #: rank 0 searches the live parameters (Bayesian optimisation) during the first steps
    autotune: bool = False
    #: CSV of every autotuning sample ("" = none)
    autotune_log_file: str = ""
    #: samples discarded before the search starts (the job is still warming up)
    autotune_warmup_samples: int = 3
    #: training steps (a repeat of a tensor name ends one) measured per sample
    autotune_steps_per_sample: int = 10
    #: samples the Bayesian optimisation takes before it keeps the best
    autotune_bayes_opt_max_samples: int = 20
    #: noise (alpha) of the Gaussian process on normalised scores
    autotune_gaussian_process_noise: float = 0.8

    def __post_init__(self):
        if self.size < 1:
            raise HvdliteConfigError(f"{SIZE}={self.size}: the job size must be at least 1")
        if not 0 <= self.rank < self.size:
            raise HvdliteConfigError(
                f"{RANK}={self.rank} is outside 0..{self.size - 1} ({SIZE}={self.size})")
        for field, (lo, hi, what) in _RANGES.items():
            value = getattr(self, field)
            var = _FROM_ENV[field][0]
            if isinstance(value, float) and not math.isfinite(value):
                raise HvdliteSettingError(var, value, f"must be a finite number ({what})")
            if value < lo or (hi is not None and value > hi):
                raise HvdliteSettingError(var, value, f"must be {what}")
        if self.cpu_operations not in ("", "gloo", "mpi", "local"):
            raise HvdliteConfigError(
                f"{CPU_OPERATIONS}={self.cpu_operations!r}: expected 'gloo' or 'mpi'")
        if self.autotune_warmup_samples < 0:
            raise HvdliteConfigError(f"{AUTOTUNE_WARMUP_SAMPLES} must be >= 0")
        if self.autotune_steps_per_sample < 1:
            raise HvdliteConfigError(f"{AUTOTUNE_STEPS_PER_SAMPLE} must be >= 1")
        if self.autotune_bayes_opt_max_samples < 1:
            raise HvdliteConfigError(f"{AUTOTUNE_BAYES_OPT_MAX_SAMPLES} must be >= 1")
        if not self.autotune_gaussian_process_noise > 0:
            raise HvdliteConfigError(f"{AUTOTUNE_GAUSSIAN_PROCESS_NOISE} must be > 0")
        try:
            level = log_level_name(self.log_level)
        except HvdliteConfigError as exc:
            raise HvdliteConfigError(f"{LOG_LEVEL}: {exc}") from None
        object.__setattr__(self, "log_level", level)     # Python's name, for setLevel

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None,
                 warn: bool = True) -> "Config":
        """Build the config from ``HVDLITE_*`` variables, or else their ``HOROVOD_*`` twins.

        A variable that is unset or empty leaves the field at its default above.  Unknown
        ``HVDLITE_*`` names are warned about; so are, in one warning naming each with the
        reason, the ``HOROVOD_*`` variables that have no effect here (``warn=False``: no
        warnings, for the launcher's own check of the same values).

        Raises:
            HvdliteConfigError: a value does not parse or is out of range (names the
                variable), or another launcher (torchrun) started this process as one of
                several ranks without hvdlite's rendezvous (see :func:`check_launcher`).
        """
        env = _with_taken_secrets() if environ is None else environ
        check_launcher(env)
        for name in env if warn else ():
            if name.startswith(PREFIX) and name not in _KNOWN:
                log.warning("unknown variable %s is ignored (known: %s)",
                            name, ", ".join(sorted(_KNOWN)))
        notes = _no_effect_notes(env)
        values = {}
        from_horovod = []
        for field, (name, kind) in _FROM_ENV.items():
            raw, source = _lookup(env, name, kind, notes)
            if raw is None:
                continue
            if source != name:
                from_horovod.append(f"{source}={raw}")
            if kind is bool:
                values[field] = _parse_bool(source, raw)
            elif kind in (int, float):
                values[field] = _parse_number(source, raw, kind)
            else:
                values[field] = raw
        if "secret_key" in values:
            try:
                values["secret_key"] = bytes.fromhex(values["secret_key"])
            except ValueError:
                raise HvdliteConfigError(f"{SECRET_KEY} is not hex") from None
        if "stall_check" in values:           # the variable says "disable"
            values["stall_check"] = not values["stall_check"]
        values["cpu_operations"] = values.get("cpu_operations", "").strip().lower()
        values.setdefault("hostname", _this_host())
        if values["cpu_operations"] == "gloo" and "rendezvous_addr" not in values:
            _check_gloo_under_mpi(env, _lookup(env, CPU_OPERATIONS, str, [])[1])
        if warn:
            _warn_once(notes)
        try:
            config = cls(**values)
            if environ is None:
                _take_secrets()
            return config
        except HvdliteConfigError as exc:
            if not from_horovod:
                raise
            raise HvdliteConfigError(
                f"{exc} (read from Horovod's {', '.join(from_horovod)})") from None

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


#: field -> (variable, type) for every field read by :meth:`Config.from_env`
_FROM_ENV = {
    "rank": (RANK, int), "size": (SIZE, int), "local_rank": (LOCAL_RANK, int),
    "local_size": (LOCAL_SIZE, int), "cross_rank": (CROSS_RANK, int),
    "cross_size": (CROSS_SIZE, int), "hostname": (HOSTNAME, str),
    "rendezvous_addr": (RENDEZVOUS_ADDR, str), "rendezvous_port": (RENDEZVOUS_PORT, int),
    "secret_key": (SECRET_KEY, str), "job_id": (JOB_ID, str), "elastic": (ELASTIC, bool),
    "elastic_timeout_s": (ELASTIC_TIMEOUT, float),
    "gloo_iface": (GLOO_IFACE, str),
    "gloo_threads": (GLOO_THREADS, int), "cpu_operations": (CPU_OPERATIONS, str),
    "fusion_threshold_bytes": (FUSION_THRESHOLD, int), "fusion_chunk_bytes": (FUSION_CHUNK, int),
    "inplace_threshold_bytes": (INPLACE_THRESHOLD, int), "cycle_time_ms": (CYCLE_TIME, float),
    "cache_capacity": (CACHE_CAPACITY, int), "op_timeout_s": (OP_TIMEOUT, float),
    "start_timeout_s": (START_TIMEOUT, float), "stall_check": (STALL_CHECK_DISABLE, bool),
    "dynamic_process_sets": (DYNAMIC_PROCESS_SETS, bool),
    "shared_memory": (SHARED_MEMORY, bool),
    "gc_freeze": (GC_FREEZE, bool),
    "stall_check_warning_time_s": (STALL_CHECK_WARNING_TIME, float),
    "stall_check_shutdown_time_s": (STALL_CHECK_SHUTDOWN_TIME, float),
    "log_level": (LOG_LEVEL, str),
    "timeline_filename": (TIMELINE, str), "timeline_mark_cycles": (TIMELINE_MARK_CYCLES, bool),
    "autotune": (AUTOTUNE, bool), "autotune_log_file": (AUTOTUNE_LOG, str),
    "autotune_warmup_samples": (AUTOTUNE_WARMUP_SAMPLES, int),
    "autotune_steps_per_sample": (AUTOTUNE_STEPS_PER_SAMPLE, int),
    "autotune_bayes_opt_max_samples": (AUTOTUNE_BAYES_OPT_MAX_SAMPLES, int),
    "autotune_gaussian_process_noise": (AUTOTUNE_GAUSSIAN_PROCESS_NOISE, float),
}


#: field -> (lowest, highest or None, the rule in words) for every numeric tunable; the
#: byte counts and the cycle time travel in the int32 control vector, hence their bound
_RANGES = {
    "fusion_threshold_bytes": (0, INT32_MAX, f"0..{INT32_MAX} bytes (0 turns fusion off)"),
    "fusion_chunk_bytes": (1, INT32_MAX, f"1..{INT32_MAX} bytes"),
    "inplace_threshold_bytes": (0, INT32_MAX, f"0..{INT32_MAX} bytes"),
    "cycle_time_ms": (0.0, INT32_MAX / 1000.0 - 1, f"0..{INT32_MAX // 1000} ms"),
    "cache_capacity": (0, 1 << 20, f"0..{1 << 20} entries (0 turns the cache off)"),
    "gloo_threads": (1, 1024, "1..1024 threads"),
    "op_timeout_s": (1e-3, 1e7, "> 0 seconds"),
    "start_timeout_s": (1e-3, 1e7, "> 0 seconds"),
    "elastic_timeout_s": (1e-3, 1e7, "> 0 seconds"),
    "stall_check_warning_time_s": (0.0, 1e7, ">= 0 seconds"),
    "stall_check_shutdown_time_s": (0.0, 1e7, ">= 0 seconds (0: never shut down)"),
}


#: variables that hold a secret: once ``from_env`` has read them from ``os.environ`` they
#: are removed from it (so that children the training script starts -- data-loader
#: workers, shell commands -- do not inherit them) and kept here for later ``init()``
#: calls in this process (``shutdown()`` then ``init()``, elastic resets)
SECRET_VARIABLES = (SECRET_KEY,)
_TAKEN: Dict[str, str] = {}
#: the variables naming the job the taken secrets belong to: they are given back only to
#: the same job (a process that is handed another job's variables does not get them)
_JOB_VARIABLES = (JOB_ID, RENDEZVOUS_ADDR, RENDEZVOUS_PORT)
_TAKEN_FOR: Tuple[Optional[str], ...] = ()


def _with_taken_secrets() -> Dict[str, str]:
    """``os.environ`` plus the secrets already taken out of it for the same job (the
    environment wins)."""
    env = dict(os.environ)
    if _TAKEN and tuple(env.get(v) for v in _JOB_VARIABLES) == _TAKEN_FOR:
        for name, value in _TAKEN.items():
            env.setdefault(name, value)
    return env


def _take_secrets() -> None:
    """Move the secret variables from ``os.environ`` into this module."""
    global _TAKEN_FOR
    for name in SECRET_VARIABLES:
        value = os.environ.pop(name, None)
        if value:
            _TAKEN[name] = value
            _TAKEN_FOR = tuple(os.environ.get(v) for v in _JOB_VARIABLES)


def _this_host() -> str:
    import socket
    return socket.gethostname()


def _is_on(raw: str) -> bool:
    """Horovod's reading of a boolean variable: anything but empty, 0 or false is on."""
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


def _comparable(name: str, raw: str, kind):
    """A value in a form where two spellings of the same setting compare equal."""
    try:
        if kind is bool:
            return _parse_bool(name, raw)
        if kind in (int, float):
            return _parse_number(name, raw, kind)
    except HvdliteConfigError:
        return raw
    return raw.strip().lower()


def _lookup(env: Mapping[str, str], name: str, kind,
            notes: List[str]) -> Tuple[Optional[str], str]:
    """``(text, variable it came from)`` of one setting: ours, else its first usable
    Horovod twin.  A twin that is overridden with a different value, or whose value hvdlite
    cannot honour, is added to ``notes``."""
    own = env.get(name)
    chosen: Tuple[Optional[str], str] = (own if own else None, name)
    for twin in _TWINS.get(name, ()):
        raw = env.get(twin)
        if not raw:
            continue
        if name == CPU_OPERATIONS and raw.strip().lower() not in _HOROVOD_CONTROLLERS:
            notes.append(f"{twin}={raw} (hvdlite runs its collectives through Gloo or MPI "
                         f"only)")
            continue
        if chosen[0] is None:
            chosen = (raw, twin)
        elif _comparable(twin, raw, kind) != _comparable(chosen[1], chosen[0], kind):
            notes.append(f"{twin}={raw} ({chosen[1]}={chosen[0]} is set and wins)")
    return chosen


def _no_effect_notes(env: Mapping[str, str]) -> List[str]:
    """``NAME=value (why)`` for each Horovod variable set to a value hvdlite cannot honour."""
    notes = []
    for name, (when, why) in HOROVOD_NO_EFFECT.items():
        raw = env.get(name)
        if not raw:
            continue
        if when == _ANY or (when == _ON) == _is_on(raw):
            notes.append(f"{name}={raw} ({why})")
    return notes


def _warn_once(notes: List[str]) -> None:
    """Log the no-effect notes as one warning, once per process for the same notes."""
    if not notes:
        return
    message = ("these Horovod variables have no effect in hvdlite: " + "; ".join(notes))
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


def check_launcher(environ: Mapping[str, str]) -> None:
    """Refuse a process that another launcher started as one rank of several.

    torchrun and ``torch.distributed``'s launchers set ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``, but not hvdlite's rendezvous; ``init()`` would then
    quietly run WORLD_SIZE separate 1-rank jobs that each train on their own.  Processes
    of hvdlite-run (rendezvous set) or of mpiexec (MPI's rank variables set) pass, and so
    does an explicit ``HVDLITE_SIZE`` (e.g. ``HVDLITE_SIZE=1`` to really run alone).

    Raises:
        HvdliteConfigError: the process looks like one of several torchrun ranks.
    """
    if any(not environ.get(v) for v in TORCH_LAUNCHER_VARIABLES):
        return
    try:
        world = int(environ["WORLD_SIZE"])
    except ValueError:
        return
    if world <= 1 or environ.get(RENDEZVOUS_ADDR) or environ.get(SIZE):
        return
    if any(v in environ for v in MPI_LAUNCH_VARIABLES):
        return
    raise HvdliteConfigError(
        f"this process was started by torchrun or another launcher that sets RANK, "
        f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT (WORLD_SIZE={world}), not by hvdlite-run: "
        f"init() would run {world} separate 1-rank jobs that never exchange a gradient. "
        f"Launch with 'hvdlite-run -np {world} python train.py' (or 'mpiexec -n {world} "
        f"python train.py'); to really run each process alone, set {SIZE}=1")


def _check_gloo_under_mpi(environ: Mapping[str, str], source: str) -> None:
    """Refuse Gloo in a process of a several-rank mpiexec job that has no rendezvous.

    Without hvdlite-run's rendezvous, Gloo cannot find the other ranks and each process
    would train alone; an exported ``HOROVOD_CONTROLLER=gloo`` must not do that silently.

    Raises:
        HvdliteConfigError: names the variable that chose Gloo.
    """
    for name in MPI_SIZE_VARIABLES:
        try:
            world = int(environ.get(name, "1"))
        except ValueError:
            continue
        if world > 1:
            raise HvdliteConfigError(
                f"{source}={environ.get(source)} chooses Gloo, but this process is one of "
                f"{world} ranks started by mpiexec without hvdlite-run's rendezvous, so each "
                f"rank would run alone; unset {source} (MPI is then used) or launch with "
                f"hvdlite-run")


def horovod_twins(name: str) -> Tuple[str, ...]:
    """The Horovod variables read when our variable ``name`` is unset (for help texts)."""
    return _TWINS.get(name, ())


def env_value(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The text of our variable ``name``, or else of its first Horovod twin that is set.

    For settings the launcher itself reads (the start and elastic timeouts), so that it
    honours ``HOROVOD_START_TIMEOUT`` as horovodrun does.  ``None`` when neither is set.
    """
    env = os.environ if environ is None else environ
    return _lookup(env, name, str, [])[0]


def rank_env(rank: int, size: int, local_rank: int, local_size: int,
             cross_rank: int, cross_size: int, hostname: str) -> Dict[str, str]:
    """The identity variables of one rank, under both our names and Horovod's."""
    values = {RANK: rank, SIZE: size, LOCAL_RANK: local_rank, LOCAL_SIZE: local_size,
              CROSS_RANK: cross_rank, CROSS_SIZE: cross_size, HOSTNAME: hostname}
    env = {k: str(v) for k, v in values.items()}
    env.update({HOROVOD_ALIASES[k]: str(v) for k, v in values.items()})
    return env
