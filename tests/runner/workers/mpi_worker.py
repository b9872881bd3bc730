"""Under --mpi: rank identity from MPI itself; allreduce through mpi4py."""

import os
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
assert os.environ.get("HVDLITE_CPU_OPERATIONS") == "mpi", os.environ.get("HVDLITE_CPU_OPERATIONS")
total = comm.allreduce(comm.Get_rank() + 1)
print(
    f"MPIOK rank={comm.Get_rank()} size={comm.Get_size()} sum={total} "
    f"cycle={os.environ.get('HVDLITE_CYCLE_TIME')} x={os.environ.get('MPI_X_VAR')}",
    flush=True,
)
if len(sys.argv) > 1 and int(sys.argv[1]) == comm.Get_rank():
    sys.exit(5)
