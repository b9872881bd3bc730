"""One frozen object holding every tunable and every launcher-provided fact.

Each ``HVDLITE_*`` name is spelled exactly once, here.  The launcher turns its
flags into these variables (``runner`` imports the names from this module), and
``init()`` reads them once with :meth:`Config.from_env`.
"""

import dataclasses
import logging
import os
from typing import Dict, Mapping, Optional

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

    def __post_init__(self):
        if self.size < 1:
            raise HvdliteConfigError(f"{SIZE}={self.size}: the job size must be at least 1")
        if not 0 <= self.rank < self.size:
            raise HvdliteConfigError(
                f"{RANK}={self.rank} is outside 0..{self.size - 1} ({SIZE}={self.size})")
        if self.fusion_threshold_bytes < 0:
            raise HvdliteConfigError(f"{FUSION_THRESHOLD} must be >= 0 bytes")
        if self.fusion_chunk_bytes < 1:
            raise HvdliteConfigError(f"{FUSION_CHUNK} must be >= 1 byte")
        if self.inplace_threshold_bytes < 0:
            raise HvdliteConfigError(f"{INPLACE_THRESHOLD} must be >= 0 bytes")
        if self.cycle_time_ms < 0:
            raise HvdliteConfigError(f"{CYCLE_TIME} must be >= 0 ms")
        if self.cache_capacity < 0:
            raise HvdliteConfigError(f"{CACHE_CAPACITY} must be >= 0")
        if self.gloo_threads < 1:
            raise HvdliteConfigError(f"{GLOO_THREADS} must be at least 1")
        if self.op_timeout_s <= 0:
            raise HvdliteConfigError(f"{OP_TIMEOUT} must be > 0 seconds")
        if self.cpu_operations not in ("", "gloo", "mpi", "local"):
            raise HvdliteConfigError(
                f"{CPU_OPERATIONS}={self.cpu_operations!r}: expected 'gloo' or 'mpi'")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """Build the config from ``HVDLITE_*`` variables, warning about unknown ones.

        A variable that is unset or empty leaves the field at its default above.
        """
        env = os.environ if environ is None else environ
        for name in env:
            if name.startswith(PREFIX) and name not in _KNOWN:
                log.warning("unknown variable %s is ignored (known: %s)",
                            name, ", ".join(sorted(_KNOWN)))
        values = {}
        for field, (name, kind) in _FROM_ENV.items():
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            if kind is bool:
                values[field] = _parse_bool(name, raw)
            elif kind in (int, float):
                values[field] = _parse_number(name, raw, kind)
            else:
                values[field] = raw
        if "secret_key" in values:
            try:
                values["secret_key"] = bytes.fromhex(values["secret_key"])
            except ValueError:
                raise HvdliteConfigError(f"{SECRET_KEY} is not hex") from None
        if "stall_check" in values:           # the variable says "disable"
            values["stall_check"] = not values["stall_check"]
        values["cpu_operations"] = values.get("cpu_operations", "").lower()
        values["log_level"] = values.get("log_level", cls.log_level).upper()
        values.setdefault("hostname", _this_host())
        return cls(**values)

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
    "stall_check_warning_time_s": (STALL_CHECK_WARNING_TIME, float),
    "stall_check_shutdown_time_s": (STALL_CHECK_SHUTDOWN_TIME, float),
    "log_level": (LOG_LEVEL, str),
}


def _this_host() -> str:
    import socket
    return socket.gethostname()


def rank_env(rank: int, size: int, local_rank: int, local_size: int,
             cross_rank: int, cross_size: int, hostname: str) -> Dict[str, str]:
    """The identity variables of one rank, under both our names and Horovod's."""
    values = {RANK: rank, SIZE: size, LOCAL_RANK: local_rank, LOCAL_SIZE: local_size,
              CROSS_RANK: cross_rank, CROSS_SIZE: cross_size, HOSTNAME: hostname}
    env = {k: str(v) for k, v in values.items()}
    env.update({HOROVOD_ALIASES[k]: str(v) for k, v in values.items()})
    return env
