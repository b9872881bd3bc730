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
SECRET_KEY = "HVDLITE_SECRET_KEY"  # hex; never on a command line
JOB_ID = "HVDLITE_JOB_ID"
GLOO_IFACE = "HVDLITE_GLOO_IFACE"
#: "1" when the elastic driver runs the job (rounds change membership while it runs)
ELASTIC = "HVDLITE_ELASTIC"
#: "1": refuse a process that torchrun's variables place in a job (the old behaviour),
#: instead of rendezvousing through torch's store (set by a user, not by the launcher)
REFUSE_TORCHRUN = "HVDLITE_REFUSE_TORCHRUN"

# --- hvdlite.run (set by ``hvdlite.run`` for the workers it starts) ---
#: hex key of the function service; travels like the job key, never on a command line
RUN_FUNC_KEY = "HVDLITE_RUN_FUNC_KEY"
RUN_FUNC_PORT = "HVDLITE_RUN_FUNC_PORT"
#: comma-separated addresses of the caller's host, tried in order
RUN_FUNC_ADDRS = "HVDLITE_RUN_FUNC_ADDRS"

# --- torchrun's worker environment (set for the ranks of a static Gloo job, so that a
# torch.distributed program's init_process_group(env://) works unchanged; --no-torch-env
# turns it off).  Not HVDLITE_* names: these are torch's.
TORCH_RANK = "RANK"
TORCH_WORLD_SIZE = "WORLD_SIZE"
TORCH_LOCAL_RANK = "LOCAL_RANK"
TORCH_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
TORCH_GROUP_RANK = "GROUP_RANK"  # the host's index in the job
TORCH_GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"  # the number of hosts
TORCH_ROLE_RANK = "ROLE_RANK"
TORCH_ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
TORCH_ROLE_NAME = "ROLE_NAME"
TORCH_MASTER_ADDR = "MASTER_ADDR"
TORCH_MASTER_PORT = "MASTER_PORT"
TORCH_RUN_ID = "TORCHELASTIC_RUN_ID"
#: every rank is a client of the store the launcher serves (as under torchrun's agent)
TORCH_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: the interface torch's own Gloo groups bind to (set on hosts the launcher reached over
#: SSH, to the interface it found routable between them, unless a rank's environment names one)
TORCH_GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
TORCH_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCH_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
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
LAUNCHER_SET = frozenset(
    v
    for k, v in dict(globals()).items()
    if k.isupper() and isinstance(v, str) and v.startswith(PREFIX) and v != PREFIX
)
