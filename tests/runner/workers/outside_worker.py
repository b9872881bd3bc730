"""A plain torch.distributed program (no hvdlite in it) whose ranks block in user code, for
stacks taken from outside the ranks (py-spy).

``outside_worker.py FLAG [--hold-gil-rank R]``: every rank meets its peers through torch's
env:// rendezvous, runs one allreduce, prints ``BLOCKING rank=R pid=P`` and waits in
:func:`wait_in_user_code` until the file FLAG exists (at most 60 s).  Rank R waits holding
the interpreter lock in a C call (``usleep`` through ``ctypes.PyDLL``), so no Python thread
of it runs meanwhile.
"""

import argparse
import ctypes
import os
import time

import torch
import torch.distributed as dist


def wait_in_user_code(flag: str, hold_gil: bool) -> None:
    deadline = time.monotonic() + 60
    libc = ctypes.PyDLL(None)  # PyDLL: the interpreter lock stays held during the call
    while not os.path.exists(flag) and time.monotonic() < deadline:
        if hold_gil:
            libc.usleep(500_000)
        else:
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("flag")
    parser.add_argument("--hold-gil-rank", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"BLOCKING rank={rank} pid={os.getpid()} total={total.item():g}", flush=True)
    wait_in_user_code(args.flag, rank == args.hold_gil_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
