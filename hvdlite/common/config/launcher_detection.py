"""Which launcher started this process: torchrun's ranks rendezvous through torch's store,
and a start that would train alone (mpiexec with Gloo chosen) is refused.

A process started by mpiexec with Gloo chosen, without hvdlite-run's rendezvous, would
run as a 1-rank job while its peers do the same; that silent waste is an error at
``init()``.
"""

from typing import Dict, Mapping, Optional

from hvdlite.common.config.env_names import RENDEZVOUS_ADDR, REFUSE_TORCHRUN, SIZE
from hvdlite.common.exceptions import HvdliteConfigError

#: what torchrun (and torch.distributed's other launchers) set in every process
TORCH_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: set in every process an MPI process manager starts (Hydra, Open MPI, PMIx, Intel MPI)
MPI_LAUNCH_VARIABLES = (
    "PMI_RANK",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
)
#: the job size as MPI process managers publish it
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


def torchrun_facts(environ: Mapping[str, str]) -> Optional[Dict[str, object]]:
    """This process's place in a job that torchrun (or a launcher setting its variables:
    a PyTorchJob, a cloud trainer) started as one rank of several, as ``Config`` fields;
    None for any other start.

    torchrun and ``torch.distributed``'s launchers set ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` but not hvdlite's rendezvous; the ranks then meet
    at torch's store (``torch_store_addr``) instead of the launcher's.  Processes of
    hvdlite-run (rendezvous set) or of mpiexec (MPI's rank variables set) are not torchrun's,
    and an explicit ``HVDLITE_SIZE`` (e.g. ``HVDLITE_SIZE=1`` to really run alone) wins.

    Raises:
        HvdliteConfigError: torchrun's variables do not describe a place in the job
            (names the variable), or ``HVDLITE_REFUSE_TORCHRUN`` asks to refuse them.
    """
    if any(not environ.get(v) for v in TORCH_LAUNCHER_VARIABLES):
        return None
    world = _torch_int(environ, "WORLD_SIZE", None)
    if world <= 1 or environ.get(RENDEZVOUS_ADDR) or environ.get(SIZE):
        return None
    if any(v in environ for v in MPI_LAUNCH_VARIABLES):
        return None
    if environ.get(REFUSE_TORCHRUN, "").strip().lower() not in ("", "0", "false", "no"):
        raise HvdliteConfigError(
            f"this process was started by torchrun or another launcher that sets RANK, "
            f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT (WORLD_SIZE={world}), and "
            f"{REFUSE_TORCHRUN} refuses such starts; launch with 'hvdlite-run -np {world} "
            f"python train.py', or unset {REFUSE_TORCHRUN} to rendezvous through torchrun's "
            f"store"
        )
    rank = _torch_int(environ, "RANK", None)
    local_size = _torch_int(environ, "LOCAL_WORLD_SIZE", 1)
    local_rank = _torch_int(environ, "LOCAL_RANK", 0)
    if not 0 <= rank < world or not 0 <= local_rank < local_size or world % local_size:
        raise HvdliteConfigError(
            f"torchrun's variables do not describe one place in the job: RANK={rank}, "
            f"WORLD_SIZE={world}, LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_size} "
            f"(hvdlite needs the same number of ranks on every node)"
        )
    node = _torch_int(environ, "GROUP_RANK", rank // local_size)
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = environ.get("TORCHELASTIC_RUN_ID", "") or "job"
    return {
        "rank": rank,
        "size": world,
        "local_rank": local_rank,
        "local_size": local_size,
        "cross_rank": node,
        "cross_size": world // local_size,
        "torch_store_addr": f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
        "job_id": f"torchrun-{run_id}-attempt{attempt}",
    }


def _torch_int(environ: Mapping[str, str], name: str, default: Optional[int]) -> int:
    raw = environ.get(name, "")
    if not raw and default is not None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise HvdliteConfigError(
            f"{name}={raw!r} (set by torchrun or your launcher) is not an integer"
        ) from None


def check_gloo_under_mpi(environ: Mapping[str, str], source: str) -> None:
    """Refuse Gloo in a process of a several-rank mpiexec job that has no rendezvous.

    Without hvdlite-run's rendezvous, Gloo cannot find the other ranks and each process
    would train alone; an exported ``HOROVOD_CONTROLLER=gloo`` must not do that silently.
    ``source`` is the variable that chose Gloo.

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
                f"hvdlite-run"
            )
