"""One frozen object holding every tunable and every launcher-provided fact.

The tunables are described once, as rows of ``tunables.TUNABLES``, and the variables
the launcher sets for each rank in ``env_names``; ``Config`` is built from both, and
``init()`` reads it once with :meth:`Config.from_env`.  The launcher turns its flags into
the same variables (``runner`` imports the names from this module).

Horovod users keep their environment: Horovod's tuning variables are read as
fallbacks of ours (an ``HVDLITE_*`` value wins over its ``HOROVOD_*`` twin), and
the ``HOROVOD_*`` variables that mean nothing here are named in one warning,
each with the reason, instead of being silently dropped.
"""

import dataclasses
import logging
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from hvdlite.common import fault_injection
from hvdlite.common.config import tunables

# the launcher-set names, imported here so that every variable name comes from this module
from hvdlite.common.config.env_names import (  # noqa: F401
    CROSS_RANK,
    CROSS_SIZE,
    ELASTIC,
    GLOO_IFACE,
    HOROVOD_ALIASES,
    HOROVOD_PREFIX,
    HOSTNAME,
    JOB_ID,
    LAUNCHER_SET,
    LOCAL_RANK,
    LOCAL_SIZE,
    PREFIX,
    RANK,
    RENDEZVOUS_ADDR,
    RENDEZVOUS_PORT,
    RUN_FUNC_ADDRS,
    RUN_FUNC_KEY,
    RUN_FUNC_PORT,
    SECRET_KEY,
    SIZE,
    TORCH_GLOO_SOCKET_IFNAME,
    TORCH_GROUP_RANK,
    TORCH_GROUP_WORLD_SIZE,
    TORCH_LOCAL_RANK,
    TORCH_LOCAL_WORLD_SIZE,
    TORCH_MASTER_ADDR,
    TORCH_MASTER_PORT,
    TORCH_MAX_RESTARTS,
    TORCH_RANK,
    TORCH_RESTART_COUNT,
    TORCH_ROLE_NAME,
    TORCH_ROLE_RANK,
    TORCH_ROLE_WORLD_SIZE,
    TORCH_RUN_ID,
    TORCH_USE_AGENT_STORE,
    TORCH_WORLD_SIZE,
)
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.config.launcher_detection import check_gloo_under_mpi, torchrun_facts
from hvdlite.common.config.log_levels import LOG_LEVEL_NAMES, log_level_name  # noqa: F401
from hvdlite.common.config.secret_env import environ_with_taken_secrets, take_secrets

log = logging.getLogger(__name__)


def _env(field: str) -> str:
    return tunables.BY_FIELD[field].env


# --- the tunables' variables (each spelled in the table) ---
CPU_OPERATIONS = _env("cpu_operations")
FUSION_THRESHOLD = _env("fusion_threshold_bytes")
FUSION_CHUNK = _env("fusion_chunk_bytes")
INPLACE_THRESHOLD = _env("inplace_threshold_bytes")
CYCLE_TIME = _env("cycle_time_ms")
CACHE_CAPACITY = _env("cache_capacity")
OP_TIMEOUT = _env("op_timeout_s")
FAULT_AT = _env("fault_at")
START_TIMEOUT = _env("start_timeout_s")
MAX_WORKERS = _env("max_workers")
ELASTIC_TIMEOUT = _env("elastic_timeout_s")
GLOO_THREADS = _env("gloo_threads")
STALL_CHECK_DISABLE = _env("stall_check")
STALL_CHECK_WARNING_TIME = _env("stall_check_warning_time_s")
STALL_CHECK_SHUTDOWN_TIME = _env("stall_check_shutdown_time_s")
LOG_LEVEL = _env("log_level")
SHARED_MEMORY = _env("shared_memory")
GC_FREEZE = _env("gc_freeze")
DYNAMIC_PROCESS_SETS = _env("dynamic_process_sets")
TIMELINE = _env("timeline_filename")
TIMELINE_MARK_CYCLES = _env("timeline_mark_cycles")
TIMELINE_MAX_BYTES = _env("timeline_max_bytes")
FLIGHT_RECORDER_SIZE = _env("flight_recorder_size")
FLIGHT_RECORDER_DIR = _env("flight_recorder_dir")
AUTOTUNE = _env("autotune")
AUTOTUNE_LOG = _env("autotune_log_file")
AUTOTUNE_WARMUP_SAMPLES = _env("autotune_warmup_samples")
AUTOTUNE_STEPS_PER_SAMPLE = _env("autotune_steps_per_sample")
AUTOTUNE_BAYES_OPT_MAX_SAMPLES = _env("autotune_bayes_opt_max_samples")
AUTOTUNE_GAUSSIAN_PROCESS_NOISE = _env("autotune_gaussian_process_noise")

#: every HVDLITE_* name hvdlite reads or sets
_KNOWN = set(LAUNCHER_SET) | {t.env for t in tunables.TUNABLES}

# --- Horovod's variables --------------------------------------------------------------------

#: Horovod's runtime variables that set one of ours when ours is unset (Horovod's name ->
#: ours; several twins of one variable are tried in table order).  Units agree: the fusion
#: threshold is in bytes, the cycle time in ms, the timeouts in seconds.
HOROVOD_FALLBACKS: Dict[str, str] = {twin: t.env for t in tunables.TUNABLES for twin in t.horovod}
#: ours -> its Horovod twins, in lookup order
_TWINS: Dict[str, Tuple[str, ...]] = {t.env: t.horovod for t in tunables.TUNABLES if t.horovod}
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
        _ON,
        "hvdlite fuses grouped tensors like any others; keeping groups apart is not implemented",
    ),
    "HOROVOD_BATCH_D2D_MEMCOPIES": (_ANY, _CPU_ONLY),
    "HOROVOD_NUM_NCCL_STREAMS": (_ANY, "NCCL is GPU only; hvdlite has no NCCL"),
    "HOROVOD_ENABLE_ASYNC_COMPLETION": (_ON, _CPU_ONLY),
    "HOROVOD_DISABLE_NVTX_RANGES": (_ON, _CPU_ONLY),
    "HOROVOD_ENABLE_XLA_OPS": (
        _ON,
        "hvdlite's TensorFlow collectives are py_function nodes, which XLA cannot compile",
    ),
    "HOROVOD_CCL_CACHE": (_ANY, "oneCCL only; hvdlite runs Gloo or MPI"),
    "HOROVOD_MPI_THREADS_DISABLE": (
        _ON,
        "hvdlite calls MPI from its background thread, which needs MPI's thread support",
    ),
    "HOROVOD_THREAD_AFFINITY": (
        _ANY,
        "hvdlite's background loop is a Python thread and is not pinned to a core",
    ),
    "HOROVOD_GLOO_IFACE": (
        _ANY,
        "hvdlite-run picks the interface; choose it with --network-interfaces",
    ),
    "HOROVOD_LOG_HIDE_TIME": (_OFF, "hvdlite's log lines carry no timestamp"),
}

#: notes already logged by this process (``init()`` after ``shutdown()`` does not repeat them)
_WARNED: Set[str] = set()


class HvdliteSettingError(HvdliteConfigError):
    """One setting is out of range; ``variable`` names it, so that the launcher can name
    the flag or file key it came from instead."""

    def __init__(self, variable: str, value, reason: str):
        super().__init__(f"{variable}={value!r}: {reason}")
        self.variable = variable
        self.value = value
        self.reason = reason


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
        raise HvdliteConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def _check_tunable(t: tunables.Tunable, value) -> None:
    """Refuse a value outside the row's range or choices (names the variable)."""
    if t.range is not None:
        if isinstance(value, float) and not math.isfinite(value):
            raise HvdliteSettingError(t.env, value, f"must be a finite number ({t.range.words})")
        if not t.range.allows(value):
            raise HvdliteSettingError(t.env, value, f"must be {t.range.words}")
    if t.choices and value not in t.choices:
        raise HvdliteConfigError(f"{t.env}={value!r}: expected {t.choices_words}")


@dataclasses.dataclass(frozen=True)
class _JobFacts:
    """The launcher-set fields of :class:`Config`: who this rank is, where the job meets."""

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
    #: network interface Gloo binds to (the launcher picks one routable between all hosts)
    gloo_iface: str = ""
    #: "host:port" of torch's store when torchrun (not hvdlite-run) started the job: the
    #: ranks meet there (see ``launcher_detection.torchrun_facts``)
    torch_store_addr: Optional[str] = None


def _default(field: str):
    """A tunable's default, from its row: the table is the only place defaults are spelled."""
    return tunables.BY_FIELD[field].default


@dataclasses.dataclass(frozen=True)
class Config(_JobFacts):
    """Every setting of one process of a job; defaults follow Horovod's.

    The fields after the launcher-set ones are the rows of ``tunables.TUNABLES``, in the
    table's order, with its types and defaults (``tests/common/test_tunables.py`` checks
    that they agree); a new tunable is a row there and a line here.
    """

    fusion_threshold_bytes: int = _default("fusion_threshold_bytes")
    cycle_time_ms: float = _default("cycle_time_ms")
    cache_capacity: int = _default("cache_capacity")
    inplace_threshold_bytes: int = _default("inplace_threshold_bytes")
    fusion_chunk_bytes: int = _default("fusion_chunk_bytes")
    gloo_threads: int = _default("gloo_threads")
    op_timeout_s: float = _default("op_timeout_s")
    cpu_operations: str = _default("cpu_operations")
    start_timeout_s: float = _default("start_timeout_s")
    max_workers: int = _default("max_workers")
    elastic_timeout_s: float = _default("elastic_timeout_s")
    discovery_settle_s: float = _default("discovery_settle_s")
    timeline_filename: str = _default("timeline_filename")
    timeline_mark_cycles: bool = _default("timeline_mark_cycles")
    timeline_max_bytes: int = _default("timeline_max_bytes")
    autotune: bool = _default("autotune")
    autotune_log_file: str = _default("autotune_log_file")
    autotune_warmup_samples: int = _default("autotune_warmup_samples")
    autotune_steps_per_sample: int = _default("autotune_steps_per_sample")
    autotune_bayes_opt_max_samples: int = _default("autotune_bayes_opt_max_samples")
    autotune_gaussian_process_noise: float = _default("autotune_gaussian_process_noise")
    stall_check: bool = _default("stall_check")
    stall_check_warning_time_s: float = _default("stall_check_warning_time_s")
    stall_check_shutdown_time_s: float = _default("stall_check_shutdown_time_s")
    straggler_window_s: float = _default("straggler_window_s")
    metrics_port: int = _default("metrics_port")
    metrics_address: str = _default("metrics_address")
    log_level: str = _default("log_level")
    flight_recorder_size: int = _default("flight_recorder_size")
    flight_recorder_dir: str = _default("flight_recorder_dir")
    fault_at: str = _default("fault_at")
    shared_memory: bool = _default("shared_memory")
    zero_copy: bool = _default("zero_copy")
    gc_freeze: bool = _default("gc_freeze")
    tf_async_kernel: bool = _default("tf_async_kernel")
    torch_env: bool = _default("torch_env")
    allow_other_interpreter: bool = _default("allow_other_interpreter")
    merge_rank_output: bool = _default("merge_rank_output")
    dynamic_process_sets: bool = _default("dynamic_process_sets")

    def __post_init__(self) -> None:
        if self.size < 1:
            raise HvdliteConfigError(f"{SIZE}={self.size}: the job size must be at least 1")
        if not 0 <= self.rank < self.size:
            raise HvdliteConfigError(
                f"{RANK}={self.rank} is outside 0..{self.size - 1} ({SIZE}={self.size})"
            )
        for t in tunables.TUNABLES:
            _check_tunable(t, getattr(self, t.field))
        try:  # a bad plan fails at init, not later
            fault_injection.parse(self.fault_at)
        except HvdliteConfigError as exc:
            raise HvdliteConfigError(f"{FAULT_AT}: {exc}") from None
        try:
            level = log_level_name(self.log_level)
        except HvdliteConfigError as exc:
            raise HvdliteConfigError(f"{LOG_LEVEL}: {exc}") from None
        object.__setattr__(self, "log_level", level)  # Python's name, for setLevel

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, warn: bool = True) -> "Config":
        """Build the config from ``HVDLITE_*`` variables, or else their ``HOROVOD_*`` twins.

        A variable that is unset or empty leaves the field at its default.  Unknown
        ``HVDLITE_*`` names are warned about; so are, in one warning naming each with the
        reason, the ``HOROVOD_*`` variables that have no effect here (``warn=False``: no
        warnings, for the launcher's own check of the same values).

        Raises:
            HvdliteConfigError: a value does not parse or is out of range (names the
                variable), or torchrun's variables name no place in the job (see
                :func:`launcher_detection.torchrun_facts`).
        """
        env = environ_with_taken_secrets() if environ is None else environ
        torchrun = torchrun_facts(env)
        for name in env if warn else ():
            if name.startswith(PREFIX) and name not in _KNOWN:
                log.warning(
                    "unknown variable %s is ignored (known: %s)", name, ", ".join(sorted(_KNOWN))
                )
        notes = _no_effect_notes(env)
        values, from_horovod = _read_fields(env, notes)
        for field, value in (torchrun or {}).items():
            values.setdefault(field, value)
        values["cpu_operations"] = values.get("cpu_operations", "").strip().lower()
        values.setdefault("hostname", _this_host())
        if values["cpu_operations"] == "gloo" and "rendezvous_addr" not in values:
            check_gloo_under_mpi(env, _lookup(env, CPU_OPERATIONS, str, [])[1])
        if warn:
            _warn_once(notes)
        try:
            config = cls(**values)
            if environ is None:
                take_secrets()
            return config
        except HvdliteConfigError as exc:
            if not from_horovod:
                raise
            raise HvdliteConfigError(
                f"{exc} (read from Horovod's {', '.join(from_horovod)})"
            ) from None

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def tunables_of(cls, environ: Mapping[str, str]) -> "Config":
        """A config with the tunables ``environ`` sets (launcher-set facts at their
        defaults): what a launcher that has no flags of its own (a platform's job) hands
        over, so that the ranks read what this environment says.

        Raises:
            HvdliteConfigError: a tunable's value does not parse or is out of range.
        """
        return cls.from_env({n: v for n, v in environ.items() if n in _TUNABLE_NAMES}, warn=False)

    def tunable_env(self, inherited: Mapping[str, str]) -> Dict[str, str]:
        """The ``HVDLITE_*`` variables a rank needs, beside the ``inherited`` ones it
        sees anyway (the launcher's, ``-x``), to read this config's tunables with
        :meth:`from_env`: one for each value the inherited ones alone would not give.
        This is how the launcher hands its one validated config to the ranks."""
        try:
            base: Optional[Config] = Config.tunables_of(inherited)
        except HvdliteConfigError:  # what it gets wrong, the variables below mend
            base = None
        env = {}
        for t in tunables.TUNABLES:
            value = getattr(self, t.field)
            if base is not None and getattr(base, t.field) == value:
                continue
            if t.type is bool:
                env[t.env] = "1" if value != t.env_means_off else "0"
            elif t.type is float:
                env[t.env] = repr(float(value))
            else:
                env[t.env] = str(value)
        return env


#: field -> (variable, type) for every launcher-set field read by :meth:`Config.from_env`
_JOB_FROM_ENV = {
    "rank": (RANK, int),
    "size": (SIZE, int),
    "local_rank": (LOCAL_RANK, int),
    "local_size": (LOCAL_SIZE, int),
    "cross_rank": (CROSS_RANK, int),
    "cross_size": (CROSS_SIZE, int),
    "hostname": (HOSTNAME, str),
    "rendezvous_addr": (RENDEZVOUS_ADDR, str),
    "rendezvous_port": (RENDEZVOUS_PORT, int),
    "secret_key": (SECRET_KEY, str),
    "job_id": (JOB_ID, str),
    "elastic": (ELASTIC, bool),
    "gloo_iface": (GLOO_IFACE, str),
}
#: field -> (variable, type) for every field read by :meth:`Config.from_env`
_FROM_ENV = {**_JOB_FROM_ENV, **{t.field: (t.env, t.type) for t in tunables.TUNABLES}}
#: the tunables' variables and their Horovod twins
_TUNABLE_NAMES = frozenset(n for t in tunables.TUNABLES for n in (t.env, *t.horovod))
#: fields whose variable's true value turns them off (``*_DISABLE``)
_SAYS_OFF = {t.field for t in tunables.TUNABLES if t.env_means_off}


def _read_fields(env: Mapping[str, str], notes: List[str]) -> Tuple[Dict, List[str]]:
    """``({field: value}, ["TWIN=value" for each value read from a Horovod twin])`` for
    every variable set in ``env``, parsed to its field's type."""
    values: Dict[str, Any] = {}
    from_horovod = []
    for field, (name, kind) in _FROM_ENV.items():
        raw, source = _lookup(env, name, kind, notes)
        if raw is None:
            continue
        if source != name:
            from_horovod.append(f"{source}={raw}")
        if kind is bool:
            values[field] = _parse_bool(source, raw) != (field in _SAYS_OFF)
        elif kind in (int, float):
            values[field] = _parse_number(source, raw, kind)
        else:
            values[field] = raw
    if "secret_key" in values:
        try:
            values["secret_key"] = bytes.fromhex(values["secret_key"])
        except ValueError:
            raise HvdliteConfigError(f"{SECRET_KEY} is not hex") from None
    return values, from_horovod


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


def _lookup(env: Mapping[str, str], name: str, kind, notes: List[str]) -> Tuple[Optional[str], str]:
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
            notes.append(f"{twin}={raw} (hvdlite runs its collectives through Gloo or MPI only)")
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
    message = "these Horovod variables have no effect in hvdlite: " + "; ".join(notes)
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


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
