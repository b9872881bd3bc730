"""Every wait of the MPI backend is bounded: run with ``mpiexec -n 2``.

Both ranks build one :class:`MPIBackend` per operation (collectively), with an op timeout of
``TIMEOUT_S``; then rank 1 sleeps, in no collective, while rank 0 runs each operation on its
own backend.  Each must end in ``HvdliteInternalError`` naming the flag, within about the
timeout, and the backend must refuse the next call at once.  Rank 0 prints one
``TIMEDOUT <op> s=<seconds>`` line per operation and ``ALLTIMEDOUT``; rank 1 exits 0 after
its sleep.
"""

import sys
import time

import numpy as np

from hvdlite.common import arrays
from hvdlite.common.backend.mpi import MPIBackend
from hvdlite.common.engine.message import ReduceOp
from hvdlite.common.exceptions import HvdliteInternalError

TIMEOUT_S = 1.0
k = arrays.kind()


def t(n, dtype=np.float32):
    return k.from_numpy(np.ones(n, dtype=dtype))


OPS = {
    "control allreduce": lambda b: b.control_allreduce_min(np.zeros(8, np.int32)),
    "control allgather": lambda b: b.control_allgather(b"x" * 10, 16),
    "allreduce": lambda b: b.allreduce_(t(4), ReduceOp.SUM),
    "big allreduce": lambda b: b.allreduce_scaled_(t(3 << 20), ReduceOp.SUM, 0.5, 1.0),
    "allgather": lambda b: b.allgather_bytes(t(5, np.uint8), [5, 7]),
    "broadcast": lambda b: b.broadcast_(t(6), 1),
    "alltoall": lambda b: b.alltoall_bytes(t(6, np.uint8), [3, 3], [3, 3]),
    "sendrecv": lambda b: b.sendrecv_(t(4), t(4), 1),
    "block allreduce": lambda b: b.block_allreduce_(t(3, np.float64), 2),
    "process set": lambda b: b.process_set([0, 1], 7),
}

backends = [MPIBackend.for_job(timeout_s=TIMEOUT_S) for _ in OPS]
rank = backends[0].rank
if rank == 1:
    time.sleep(len(OPS) * TIMEOUT_S + 4)
    sys.exit(0)
for backend, (name, op) in zip(backends, OPS.items()):
    start = time.monotonic()
    try:
        op(backend)
    except HvdliteInternalError as exc:
        took = time.monotonic() - start
        assert "--op-timeout-seconds (1s)" in str(exc), str(exc)
        assert str(exc).startswith("rank 0"), str(exc)
        print(f"TIMEDOUT {name} s={took:.2f}: {exc}", flush=True)
    else:
        raise AssertionError(f"{name} finished without its peer")
    start = time.monotonic()
    try:
        op(backend)
    except HvdliteInternalError as exc:
        assert time.monotonic() - start < 0.5, "a broken backend waited again"
        assert "refused" in str(exc), str(exc)
    else:
        raise AssertionError(f"{name} ran on a backend whose wait timed out")
    backend.close()
print("ALLTIMEDOUT", flush=True)
