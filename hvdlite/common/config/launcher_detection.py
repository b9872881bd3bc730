"""Which launcher started this process, and refusals of starts that would train alone.

A process started by torchrun, or by mpiexec with Gloo chosen, without hvdlite-run's
rendezvous would run as a 1-rank job while its peers do the same; these checks turn that
silent waste into an error at ``init()``.
"""

from typing import Mapping

from hvdlite.common.config.env_names import RENDEZVOUS_ADDR, SIZE
from hvdlite.common.exceptions import HvdliteConfigError

#: what torchrun (and torch.distributed's other launchers) set in every process
TORCH_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: set in every process an MPI process manager starts (Hydra, Open MPI, PMIx, Intel MPI)
MPI_LAUNCH_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                        "MPI_LOCALRANKID")
#: the job size as MPI process managers publish it
MPI_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


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
                f"hvdlite-run")
