"""One rank holds the interpreter lock in a C call (``usleep`` through ``ctypes.PyDLL``,
which keeps the lock), so that no thread of it runs, while the others wait for it in an
allreduce; the launcher must name that rank, not the ones that waited.

argv: RANK SECONDS -- the rank that holds the lock, and for how long; or ``late SECONDS``:
local slot 1 sleeps that long before ``hvd.init()`` (its peer waits for it there).
"""

import ctypes
import os
import sys
import time

import torch

import hvdlite.torch as hvd


def hold_the_interpreter_lock(seconds):
    """A C call that keeps the interpreter lock (PyDLL does not release it)."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def main():
    if sys.argv[1] == "late":
        if os.environ.get("HVDLITE_LOCAL_RANK") == "1":
            time.sleep(float(sys.argv[2]))
        hvd.init()
        hvd.allreduce(torch.ones(1), name="after.init")
        return
    wedged, seconds = int(sys.argv[1]), float(sys.argv[2])
    hvd.init()
    hvd.allreduce(torch.ones(1), name="warm.up")
    if hvd.rank() == wedged:
        print(f"WEDGED rank={hvd.rank()} pid={os.getpid()}", flush=True)
        hold_the_interpreter_lock(seconds)
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.wedge")
    print(f"DONE rank={hvd.rank()} {out.tolist()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
