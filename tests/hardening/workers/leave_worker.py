"""Rank 1 leaves or goes silent after one collective: ``leave_worker.py exit0|stop``.

``exit0``: rank 1 calls ``os._exit(0)`` (no shutdown, no atexit); ``stop``: rank 1 sends
itself SIGSTOP.  The other ranks keep reducing until their collectives fail.
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
    os.kill(os.getpid(), signal.SIGSTOP)
for i in range(6000):
    hvd.allreduce(t, name=f"step{i}")
    time.sleep(0.01)
