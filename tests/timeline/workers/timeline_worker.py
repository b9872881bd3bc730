"""Runs allreduces under a timeline; the test reads the files.

``phases A B``: steps named a.* (the launcher's timeline is on; rank 1 submits a.late
late), then ``hvd.start_timeline(B)`` and steps named b.*, then ``hvd.stop_timeline()``
and steps named c.*.  ``forever PIDFILE``: steps until killed (rank 0 writes its pid
after a few steps).  Every result is checked exactly.
"""

import os
import sys
import time

import torch

import hvdlite.torch as hvd


def step(prefix, r, late=False):
    small = [torch.full((64 * (i + 1),), float(r + i)) for i in range(6)]
    big = torch.full((800_000,), float(r))  # 3.2 MB: reduced where it lies
    handles = [
        hvd.allreduce_async_(t, name=f"{prefix}.small{i}", op=hvd.Sum) for i, t in enumerate(small)
    ]
    handles.append(hvd.allreduce_async_(big, name=f"{prefix}.big", op=hvd.Sum))
    if late:
        if r == 1:
            time.sleep(0.3)
        lt = torch.full((16,), float(r))
        handles.append(hvd.allreduce_async_(lt, name=f"{prefix}.late", op=hvd.Sum))
    for h in handles:
        hvd.synchronize(h)
    size = hvd.size()
    for i, t in enumerate(small):
        assert torch.all(t == float(sum(q + i for q in range(size)))), (prefix, i)
    assert torch.all(big == float(sum(range(size))))


def main():
    hvd.init()
    r = hvd.rank()
    mode = sys.argv[1]
    if mode == "phases":
        for s in range(4):
            step("a", r, late=(s == 1))
        hvd.start_timeline(sys.argv[2])
        for _ in range(3):
            step("b", r)
        hvd.stop_timeline()
        hvd.stop_timeline()  # idempotent
        for _ in range(2):
            step("c", r)
        print(f"rank {r} done", flush=True)
    else:
        n = 0
        while True:
            step("k", r)
            n += 1
            if n == 5 and r == 0:
                with open(sys.argv[2], "w") as f:
                    f.write(str(os.getpid()))


if __name__ == "__main__":
    main()
