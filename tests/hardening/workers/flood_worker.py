"""A rank that starts only once the attack is on: ``flood_worker.py READY_FILE [STEPS]``.

Waits (at most 20 s) for the attacker's READY_FILE, then ``hvd.init()`` through the
flooded listeners, runs STEPS allreduces (default 3) and prints ``OK rank=R sum=S`` for
the last one.
"""

import os
import sys
import time

import torch

import hvdlite.torch as hvd

ready, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
deadline = time.monotonic() + 20
while not os.path.exists(ready):
    if time.monotonic() > deadline:
        sys.exit(f"the attacker never wrote {ready}")
    time.sleep(0.05)
hvd.init()
for step in range(steps):
    total = hvd.allreduce(torch.full((4,), float(hvd.rank() + 1)), op=hvd.Sum, name=f"step{step}")
    time.sleep(0.05)
print(f"OK rank={hvd.rank()} size={hvd.size()} sum={float(total[0])}", flush=True)
hvd.shutdown()
