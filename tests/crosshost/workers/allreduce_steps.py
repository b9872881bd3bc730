"""argv: STEPS NUMEL. Every step an allreduce of NUMEL floats (rank-dependent values) whose
sum is checked; prints ``STEP k`` every 10 steps, then ``SUMS_OK rank=R host=H``."""

import socket
import sys

import torch

import hvdlite.torch as hvd

hvd.init()
steps, numel = int(sys.argv[1]), int(sys.argv[2])
n = hvd.size()
for step in range(steps):
    x = torch.arange(numel, dtype=torch.float32) + hvd.rank() * step
    y = hvd.allreduce(x, op=hvd.Sum, name="steps")
    want = torch.arange(numel, dtype=torch.float32) * n + step * n * (n - 1) / 2
    assert torch.equal(y, want), (step, (y - want).abs().max())
    if step % 10 == 0:
        print(f"STEP {step} rank={hvd.rank()}", flush=True)
print(f"SUMS_OK rank={hvd.rank()} host={socket.gethostname()} cross={hvd.cross_rank()}", flush=True)
hvd.shutdown()
