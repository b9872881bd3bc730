"""Rank 1 (or, for a dump, every rank) stays in a function of this script, blocked in C
code (a lock) while the others wait in an allreduce; the launcher's stack report must name
that function.

argv: MODE SECONDS [FLAG]
  MODE     ``stall``: rank 1 dawdles, rank 0 waits in the allreduce;
           ``raise``: the same, but rank 1 first calls the allreduce on a process set it
           is not in, and catches the ValueError (as a test harness does);
           ``dump``: every rank dawdles (the test asks for stacks on demand), in the
           job's second rendezvous round (shutdown() then init() first)
  SECONDS  how long the dawdling lasts at most
  FLAG     a file the test creates once it saw the report: dawdling ends a second later
"""

import os
import sys
import threading
import time

import torch

import hvdlite.torch as hvd


def _release_when_seen(lock, seconds, flag):
    """Release ``lock`` once ``flag`` exists (a second later) or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (flag and os.path.exists(flag)):
        time.sleep(0.1)
    if flag and os.path.exists(flag):
        time.sleep(1.0)
    lock.release()


def dawdle_in_user_code(seconds, flag):
    """Block in C code, waiting for a lock, until another thread releases it (the stack
    report must still show this frame)."""
    lock = threading.Lock()
    lock.acquire()
    threading.Thread(target=_release_when_seen, args=(lock, seconds, flag), daemon=True).start()
    lock.acquire()


def main():
    mode, seconds = sys.argv[1], float(sys.argv[2])
    flag = sys.argv[3] if len(sys.argv) > 3 else None
    only_rank_0 = hvd.ProcessSet([0])
    hvd.init(process_sets=[only_rank_0])
    if mode == "raise" and hvd.rank() == 1:
        try:
            hvd.allreduce(torch.ones(2), op=hvd.Sum, name="stall.grad", process_set=only_rank_0)
        except ValueError as exc:
            print(f"CAUGHT rank=1 {exc}", flush=True)
    if mode == "dump":
        hvd.allreduce(torch.ones(1), name="round0")
        hvd.shutdown()
        hvd.init()
    if mode == "dump" or hvd.rank() == 1:
        print(f"DAWDLING rank={hvd.rank()}", flush=True)
        dawdle_in_user_code(seconds, flag)
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="stall.grad")
    assert out.tolist() == [2.0, 2.0], out
    print(f"STALLOK rank={hvd.rank()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
