"""A job that goes wrong in a known way, for the flight recorder's tests.

``mismatch``: a few good steps, then rank 1 submits ``grad.fc`` with shape [5] where
rank 0 has [4]; each rank lets the mismatch error escape (the uncaught exception dumps).
``skip``: a few good steps, then rank 1 skips ``grad.fc`` and waits in ``grad.next``;
the stall shutdown time fails both.
"""

import sys

import torch

import hvdlite.torch as hvd


def good_steps(n):
    for step in range(n):
        for name, numel in (("grad.conv", 8), ("grad.fc", 4)):
            t = hvd.allreduce(torch.ones(numel), name=name, op=hvd.Sum)
            assert torch.all(t == hvd.size()), (step, name)


def main():
    hvd.init()
    r = hvd.rank()
    good_steps(3)
    if sys.argv[1] == "mismatch":
        hvd.allreduce(torch.ones(4 if r == 0 else 5), name="grad.fc", op=hvd.Sum)
    else:
        if r == 0:
            hvd.allreduce(torch.ones(4), name="grad.fc", op=hvd.Sum)
        hvd.allreduce(torch.ones(2), name="grad.next", op=hvd.Sum)
    print(f"rank {r}: no error (unexpected)", flush=True)


if __name__ == "__main__":
    main()
