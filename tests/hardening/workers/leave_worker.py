"""Rank 1 leaves, goes silent or raises after one collective: ``leave_worker.py MODE``.

``exit0``: rank 1 calls ``os._exit(0)`` (no shutdown, no atexit); ``stop``: rank 1 sends
itself SIGSTOP; ``raise``: rank 1 raises ``ValueError`` (rank 0 then fails too, with
"rank 1 shut down").
The other ranks keep reducing until their collectives fail.
"""

import os
import signal
import sys
import time

import torch

import hvdlite.torch as hvd

hvd.init()
t = torch.ones(4)
hvd.allreduce(t, name="warm")
if hvd.rank() == 1:
    if sys.argv[1] == "exit0":
        os._exit(0)
    if sys.argv[1] == "raise":
        raise ValueError("bad batch 17 on rank one")
    os.kill(os.getpid(), signal.SIGSTOP)
for i in range(6000):
    hvd.allreduce(t, name=f"step{i}")
    time.sleep(0.01)
