"""Collectives through the shared-memory path, checked against local references.

Run with small slots (HVDLITE_FUSION_CHUNK_BYTES=4096) so big tensors cross several slots.
Prints ``SHM rank=R shm=0|1 hierarchical=0|1`` then ``OK <check> rank=R`` per check.
``--sleep S`` then waits (a rank that is to be killed meanwhile).  ``--pause-after-create S``
makes local rank 0 print ``SEGMENT_CREATED`` and sleep right after it made the host's segment,
before the other ranks map it: the moment a kill is most likely to leave something behind.
"""

import argparse
import os
import sys
import time
import traceback

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from hvdlite.common.backend import shm


def values(rank, n, dtype):
    return ((torch.arange(n) % 7) + rank + 1).to(dtype)


def check_allreduce():
    r, n = hvd.rank(), hvd.size()
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int16,
        torch.int64,
        torch.uint8,
        torch.int8,
    ):
        # 10000 floats span ten 4 KiB slots; 8193 floats end in a piece of one element
        # between hosts (16 KB pieces), whose slice on local rank 1 is empty
        for count in (1, 5, 3001, 8193, 10000):
            x = values(r, count, dtype)
            want = sum(values(k, count, torch.float64) for k in range(n))
            got = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{dtype}.{count}")
            assert got.dtype == dtype and torch.allclose(got.double(), want.to(dtype).double()), (
                dtype,
                count,
            )
    x = values(r, 2000, torch.float32)
    stack = torch.stack([values(k, 2000, torch.float32) for k in range(n)])
    assert torch.equal(hvd.allreduce(x, op=hvd.Min), stack.min(0).values)
    assert torch.equal(hvd.allreduce(x, op=hvd.Max), stack.max(0).values)
    small = torch.tensor([1.0 + r, 2.0])
    assert torch.equal(
        hvd.allreduce(small, op=hvd.Product),
        torch.tensor([float(torch.arange(1, n + 1).prod()), 2.0**n]),
    )
    flags = torch.tensor([True, r == 0, False])
    assert hvd.allreduce(flags, op=hvd.Min).tolist() == [True, n == 1, False]
    assert hvd.allreduce(flags, op=hvd.Max).tolist() == [True, True, False]
    avg = hvd.allreduce(values(r, 9000, torch.float32))
    assert torch.allclose(avg, sum(values(k, 9000, torch.float32) for k in range(n)) / n)


def check_scaling():
    """Average, prescale and postscale are applied while the data is copied in and out (and
    in the packed chunks' runs): every dtype, tensors of one and of several pieces, alone
    and fused, against float64 references with Horovod's integer truncation."""
    r, n = hvd.rank(), hvd.size()
    for dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.int16,
        torch.uint8,
        torch.int8,
    ):
        for count in (5, 3001, 10000):
            ins = [values(k, count, torch.float64) for k in range(n)]
            if dtype.is_floating_point:
                avg, scaled = sum(ins) / n, sum(x * 0.5 for x in ins) * 3.0
            else:
                avg = (sum(ins) / n).trunc()
                scaled = (sum((x * 0.5).trunc() for x in ins) * 3.0).trunc()
            tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-6)
            got = hvd.allreduce(
                values(r, count, dtype), op=hvd.Average, name=f"avg.{dtype}.{count}"
            )
            assert got.dtype == dtype and torch.allclose(got.double(), avg, rtol=tol), (
                dtype,
                count,
                got[:4],
                avg[:4],
            )
            handles = [
                hvd.allreduce_async(
                    values(r, count, dtype),
                    op=hvd.Sum,
                    prescale_factor=0.5,
                    postscale_factor=3.0,
                    name=f"scaled.{dtype}.{count}.{i}",
                )
                for i in range(3)
            ]  # fused: packed or staged
            for h in handles:
                got = hvd.synchronize(h)
                assert torch.allclose(got.double(), scaled, rtol=tol), (dtype, count, got[:4])
    # a fused group of tensors reduced where they lie (2 MiB or more): one pipeline through
    # all their pieces, averaged while copied out
    for dtype in (torch.float32, torch.int32):
        counts = (600_001, 5, 700_003)
        handles = [
            hvd.allreduce_async(values(r, c, dtype), op=hvd.Average, name=f"avg.group.{dtype}.{c}")
            for c in counts
        ]
        for c, h in zip(counts, handles):
            want = sum(values(k, c, torch.float64) for k in range(n)) / n
            if not dtype.is_floating_point:
                want = want.trunc()
            assert torch.allclose(hvd.synchronize(h).double(), want), (dtype, c)


def check_many_fused():
    r, n = hvd.rank(), hvd.size()
    handles = [
        hvd.allreduce_async(torch.full((37 + i,), float(r + i)), op=hvd.Sum, name=f"fused.{i}")
        for i in range(200)
    ]
    for i, h in enumerate(handles):
        got = hvd.synchronize(h)
        assert torch.equal(got, torch.full((37 + i,), float(sum(k + i for k in range(n)))))
    # the same names again (cache hits: the executor keeps the group's layout and the views of
    # its result in the slots), each step with its own values, 1-D and 2-D tensors
    for step in range(1, 4):
        ins = [
            torch.full((37 + i,) if i % 2 else (1, 37 + i), float(r + i + step)) for i in range(200)
        ]
        handles = [
            hvd.allreduce_async_(t, op=hvd.Sum, name=f"fused.{i}") for i, t in enumerate(ins)
        ]
        for i, (t, h) in enumerate(zip(ins, handles)):
            assert hvd.synchronize(h) is t
            assert torch.equal(
                t, torch.full(t.shape, float(sum(k + i + step for k in range(n))))
            ), (step, i)
    # with default slots: tensors of several 1 MiB pieces reduced where they lie, and a
    # fused group (each tensor under the in-place threshold) pipelined in several chunks
    sizes = [700_001, 1_048_577] + [150_000 + i for i in range(8)]
    handles = [
        hvd.allreduce_async(values(r, m, torch.float32), op=hvd.Sum, name=f"big.{m}") for m in sizes
    ]
    for m, h in zip(sizes, handles):
        want = sum(values(k, m, torch.float64) for k in range(n)).float()
        assert torch.equal(hvd.synchronize(h), want), m


def check_broadcast_allgather_alltoall():
    r, n = hvd.rank(), hvd.size()
    for root in range(n):
        t = torch.arange(5000, dtype=torch.float64) * (r + 1)  # 40 KB: several slots
        hvd.broadcast_(t, root_rank=root, name=f"bcast.{root}")
        assert torch.equal(t, torch.arange(5000, dtype=torch.float64) * (root + 1))
    for rows in (1, 700):  # 700 rows > one slot
        g = hvd.allgather(torch.full((rows + r, 3), float(r)), name=f"gather.{rows}")
        assert torch.equal(g, torch.cat([torch.full((rows + k, 3), float(k)) for k in range(n)]))
    for per in (1, 600):
        splits = [per * (k + 1) for k in range(n)]
        send = torch.cat([torch.full((s, 2), float(10 * r + k)) for k, s in enumerate(splits)])
        got, received = hvd.alltoall(send, splits=splits, name=f"a2a.{per}")
        assert received.tolist() == [per * (r + 1)] * n
        assert torch.equal(
            got, torch.cat([torch.full((per * (r + 1), 2), float(10 * k + r)) for k in range(n)])
        )
    objs = hvd.allgather_object({"rank": r, "blob": "x" * 10000})
    assert [o["rank"] for o in objs] == list(range(n))


def pause_after_create(seconds):
    """Wrap the segment's creation so this rank stops right after it."""
    create = shm.SharedMemoryGroup.create.__func__

    def paused(cls, *args, **kwargs):
        group = create(cls, *args, **kwargs)
        print(f"SEGMENT_CREATED pid={os.getpid()} at={getattr(group, 'address', None)}", flush=True)
        time.sleep(seconds)
        return group

    shm.SharedMemoryGroup.create = classmethod(paused)


CHECKS = {
    "allreduce": check_allreduce,
    "scaling": check_scaling,
    "many_fused": check_many_fused,
    "broadcast_allgather_alltoall": check_broadcast_allgather_alltoall,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(CHECKS))
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--tag", default="")
    p.add_argument("--pause-after-create", type=float, default=0.0)
    args = p.parse_args()
    if args.pause_after_create:
        pause_after_create(args.pause_after_create)
    hvd.init()
    backend = basics.runtime().backend
    shm_on = getattr(backend, "_shm", None) is not None
    hier = getattr(backend, "_cross_pg", None) is not None
    print(f"SHM rank={hvd.rank()} shm={int(shm_on)} hierarchical={int(hier)}", flush=True)
    failed = 0
    for name in args.only.split(","):
        try:
            CHECKS[name]()
            print(f"OK {name} rank={hvd.rank()}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} rank={hvd.rank()}\n{traceback.format_exc()}", flush=True)
    if args.sleep:
        print(f"SLEEPING rank={hvd.rank()}", flush=True)
        end = time.monotonic() + args.sleep
        try:
            while time.monotonic() < end:  # collectives until a peer goes away
                hvd.allreduce(torch.ones(1), name="heartbeat")
                time.sleep(0.05)
        except Exception as exc:
            print(f"PEER_FAILED rank={hvd.rank()} error={exc}", flush=True)
            sys.exit(7)
    hvd.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
