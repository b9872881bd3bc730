"""Under --mpi: one rank stops (SIGSTOP to itself) while its peer waits for it in an allreduce;
the peer must get hvdlite's named timeout error within about --op-timeout-seconds.

argv: RANK -- the rank that stops.  The waiting rank prints ``WAITED rank=R s=SECONDS`` and
``ERROR <type>: <message>`` before it re-raises (so its exit report and exit code are the
usual ones for an uncaught collective error).
"""

import os
import signal
import sys
import time

import torch

import hvdlite.torch as hvd

stopping = int(sys.argv[1])
hvd.init()
hvd.allreduce(torch.ones(1), name="warm.up")
if hvd.rank() == stopping:
    print(f"STOPPING rank={hvd.rank()} pid={os.getpid()}", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)  # only if someone sent SIGCONT: it must not be needed
    sys.exit(0)
time.sleep(0.5)  # the peer is stopped by now
start = time.monotonic()
try:
    hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after.stop")
except Exception as exc:
    print(f"WAITED rank={hvd.rank()} s={time.monotonic() - start:.2f}", flush=True)
    print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
    raise
print(f"UNEXPECTED rank={hvd.rank()}: the allreduce finished", flush=True)
