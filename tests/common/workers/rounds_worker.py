"""Joins rendezvous rounds one init() at a time (driven by tests/common/test_rounds.py).

``rounds_worker.py N``: N times init() -> report the place -> unnamed and named
allreduces -> shutdown().  The unnamed allreduce only completes if every member
of the round numbers it alike, i.e. if auto-names restart at every init().
"""

import sys

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics


def main(inits: int) -> int:
    for _ in range(inits):
        try:
            hvd.init()
        except Exception as exc:  # reported for the test to check
            print(f"INIT FAILED {type(exc).__name__}: {exc}", flush=True)
            return 3
        rank, size = hvd.rank(), hvd.size()
        total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum)
        named = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Max, name="max.rank")
        print(
            f"PLACE round={basics.rendezvous_round()} rank={rank} size={size} "
            f"sum={total.item():g} max={named.item():g}",
            flush=True,
        )
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
