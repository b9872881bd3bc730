"""Under --mpi at np=4: a process set from a communicator, and init(comm=...) with a
communicator and with a list of ranks."""

import sys

import torch
from mpi4py import MPI

from _common import hvd
from tests.worker_cases import run_each

WORLD = MPI.COMM_WORLD
ME = WORLD.Get_rank()


def set_from_communicator():
    hvd.init(process_sets="dynamic")
    comm = WORLD.Split(0 if ME < 2 else MPI.UNDEFINED, ME)  # COMM_NULL on ranks 2, 3
    ps = hvd.add_process_set(hvd.ProcessSet(comm))
    assert ps.ranks == [0, 1], ps
    if ME < 2:
        got = hvd.allreduce(torch.tensor([ME + 1.0]), op=hvd.Sum, process_set=ps)
        assert got.item() == 3.0, got
        comm.Free()
    hvd.shutdown()


def init_with_communicator():
    half = WORLD.Split(ME % 2, ME)  # two 2-rank jobs side by side
    hvd.init(comm=half)
    assert (hvd.rank(), hvd.size()) == (ME // 2, 2), (hvd.rank(), hvd.size())
    got = hvd.allreduce(torch.tensor([ME + 1.0]), op=hvd.Sum)
    assert got.item() == (1 + 3 if ME % 2 == 0 else 2 + 4), got
    hvd.shutdown()
    half.Free()


def init_with_rank_list():
    try:
        hvd.init(comm=[0, 1, 2])
    except ValueError as e:
        assert ME == 3 and "does not include this process" in str(e), e
        return
    assert ME != 3 and hvd.size() == 3 and hvd.rank() == ME
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == 3.0
    hvd.shutdown()


CASES = (set_from_communicator, init_with_communicator, init_with_rank_list)
failed = run_each({fn.__name__: fn for fn in CASES}, lambda: ME)
sys.exit(1 if failed else 0)
