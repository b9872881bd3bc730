"""The environment the ranks of one job share: built here, and only here.

Three ways reach the ranks.  A Gloo job's ranks get :func:`shared_env` (the tunables
derived from the spec's Config, ``-x`` and secret variables, the store's address, the
job id, elastic facts, torchrun's variables); remote hosts' task services also get the
allow-list :func:`forward_env` of this process's own environment; an ``--mpi`` job's
mpiexec gets :func:`mpiexec_env`, which says what goes on its command line and what is
passed by name.  Each rank's place (rank, sizes, host) is added where it starts
(``processes.workers.slot_env``), from its slot.
"""

import os
from typing import Dict, List, Optional, Tuple

from hvdlite.common import config as cfg
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.tasks.nics import loopback_interface

#: variables every host's workers get from the launcher's environment (besides -x ones)
FORWARD_ALWAYS = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
#: per-job HVDLITE_* names the launcher sets itself; never forwarded from its own environment
_JOB_NAMES = {
    cfg.RANK,
    cfg.SIZE,
    cfg.LOCAL_RANK,
    cfg.LOCAL_SIZE,
    cfg.CROSS_RANK,
    cfg.CROSS_SIZE,
    cfg.HOSTNAME,
    cfg.RENDEZVOUS_ADDR,
    cfg.RENDEZVOUS_PORT,
    cfg.SECRET_KEY,
    cfg.JOB_ID,
    cfg.GLOO_IFACE,
    cfg.ELASTIC,
    cfg.RUN_FUNC_KEY,
    cfg.RUN_FUNC_PORT,
    cfg.RUN_FUNC_ADDRS,
}
_HOROVOD_IDENTITY = set(cfg.HOROVOD_ALIASES.values())


def forwarded(name: str) -> bool:
    """Whether the launcher's variable ``name`` travels to every host's workers."""
    if name in FORWARD_ALWAYS:
        return True
    if name.startswith(cfg.PREFIX):
        return name not in _JOB_NAMES
    # the identity aliases are set per rank by the launcher, never taken from its own env
    return name.startswith(cfg.HOROVOD_PREFIX) and name not in _HOROVOD_IDENTITY


def forward_env(spec: JobSpec) -> Dict[str, str]:
    """The allow-list remote hosts get: the user's HVDLITE_* and HOROVOD_* variables,
    PATH & co, -x names, the tunables and the secret variables."""
    env = {k: v for k, v in os.environ.items() if forwarded(k)}
    env.update(spec.user_env)
    env.update(spec.tunable_env())
    env.update(spec.secret_env)
    return env


def shared_env(
    spec: JobSpec,
    store: Tuple[str, int],
    job_id: str,
    key: bytes,
    torch_port: Optional[int],
    local: bool,
    with_key: bool,
) -> Dict[str, str]:
    """What every rank of a Gloo job shares (``JobContext.job_env``).

    ``store``: the rendezvous store's address; ``torch_port``: torch's store beside it
    (None: no torchrun variables).  ``local``: the workers are children of this process,
    so they get the job key here (a task adds it itself: the key never crosses the wire)
    and Gloo's own unauthenticated listeners stay on loopback, like the store.
    ``with_key``: a platform hands the environment over an authenticated channel of its
    own (Ray's object transfer), so the key goes with it.
    """
    env = spec.tunable_env()
    env.update(spec.user_env)
    env.update(spec.secret_env)
    env.update(
        {cfg.RENDEZVOUS_ADDR: store[0], cfg.RENDEZVOUS_PORT: str(store[1]), cfg.JOB_ID: job_id}
    )
    if not spec.settings.static:
        env[cfg.ELASTIC] = "1"
    if local or with_key:
        env[cfg.SECRET_KEY] = key.hex()
    if local:
        env[cfg.GLOO_IFACE] = loopback_interface()
    if torch_port is not None:
        env.update(_torch_env(store[0], torch_port, job_id))
    return env


def _torch_env(addr: str, port: int, job_id: str) -> Dict[str, str]:
    """torchrun's variables every rank shares (each rank's place is added where it
    starts): torch's store beside ours, every rank its client, and the job's id."""
    return {
        cfg.TORCH_MASTER_ADDR: addr,
        cfg.TORCH_MASTER_PORT: str(port),
        cfg.TORCH_USE_AGENT_STORE: "True",
        cfg.TORCH_RUN_ID: job_id,
        cfg.TORCH_RESTART_COUNT: "0",
        cfg.TORCH_MAX_RESTARTS: "0",
        cfg.TORCH_ROLE_NAME: "default",
    }


def mpiexec_env(
    spec: JobSpec, job_id: str, key: bytes
) -> Tuple[Dict[str, str], List[str], Dict[str, str]]:
    """``(on_command_line, names, hidden)`` for mpiexec: the tunables go on its command
    line; everything else is passed by name from its own environment, never on a
    command line (which ``ps`` shows to every user): PATH & co, the user's HVDLITE_* and
    HOROVOD_* variables, -x values, the job key (it signs ``broadcast_object`` & co) and
    the other secret variables (``hidden``, the values of the names this process sets)."""
    hidden = dict(spec.user_env)
    hidden.update(spec.secret_env)
    hidden[cfg.SECRET_KEY] = key.hex()
    hidden[cfg.JOB_ID] = job_id  # names the ranks' flight-recorder directory
    names = [n for n in os.environ if forwarded(n) and n not in hidden] + sorted(hidden)
    return spec.tunable_env(), names, hidden
