"""np=4: rank 1 dies while in process set [0, 1]; rank 0's op on that set fails fast with
HvdliteInternalError, and set [2, 3] finishes its own op unaffected."""

import os
import time

import torch

import hvdlite.torch as hvd

hvd.init(process_sets="dynamic")
low, high = hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])
me = hvd.rank()
if me == 1:
    time.sleep(0.5)
    os._exit(3)
if me in high.ranks:
    got = hvd.allreduce(torch.tensor([me + 1.0]), op=hvd.Sum, process_set=high)
    print(f"HIGH_OK rank={me} value={got.item()}", flush=True)
    time.sleep(30)  # the launcher ends us once rank 1's exit is seen
else:
    start = time.monotonic()
    try:
        hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=low)
    except hvd.HvdliteInternalError as e:
        print(f"LOW_FAILED after={time.monotonic() - start:.1f}s error={e}", flush=True)
    time.sleep(30)
