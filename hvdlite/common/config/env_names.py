"""The variables the launcher sets for each rank and each job (not tunables: a user never
sets them), each name spelled once, here; the tunables' names are in ``tunables``."""

from typing import Dict

PREFIX = "HVDLITE_"
HOROVOD_PREFIX = "HOROVOD_"

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
#: "1" when the elastic driver runs the job (rounds change membership while it runs)
ELASTIC = "HVDLITE_ELASTIC"

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

#: every launcher-set name above
LAUNCHER_SET = frozenset(v for k, v in dict(globals()).items()
                         if k.isupper() and isinstance(v, str) and v.startswith(PREFIX)
                         and v != PREFIX)
