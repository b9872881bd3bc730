"""The compressors' own compute, alone: one process, no runtime, no communication.

    python benchmarks/compression_compute.py [--shapes mlp|resnet50] [--threads 1]

Each PowerSGD / top-k step runs the real ``GradientExchange`` code with its collectives
replaced by those of a job of one rank that returns its input (so what is timed is the
error feedback, the products, the selection and the scatter, nothing else).  Times are
per step (medians, and the best of the run, in ms) of one exchange over the gradients of
``--shapes``; ``--profile`` prints the operators that take the time.

For the share of a whole step, ``benchmarks/compression.py`` runs the same variants at np=2.
"""

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace
from unittest import mock

import torch

import hvdlite.torch as hvd
from hvdlite.torch import mpi_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import resnet50_shapes  # noqa: E402

VARIANTS = {
    "powersgd-r1": lambda: hvd.Compression.powersgd(rank=1, start_iter=0),
    "powersgd-r4": lambda: hvd.Compression.powersgd(rank=4, start_iter=0),
    "topk-1%": lambda: hvd.Compression.topk(ratio=0.01),
}

#: collectives of a job of one rank: the result is the input, at once
ALONE = SimpleNamespace(
    Sum=mpi_ops.Sum,
    Average=mpi_ops.Average,
    grouped_allreduce_async_=lambda tensors, **_kw: tensors,
    allreduce_async_=lambda tensor, **_kw: tensor,
    allgather_async=lambda tensor, **_kw: tensor,
    synchronize=lambda handle: handle,
)


def shapes_of(which: str, width: int):
    if which == "mlp":
        return [(width, width), (width,)] * 4
    return resnet50_shapes()


def run_variant(name, shapes, args):
    """Step times (ms) of one exchange over gradients of ``shapes``, each parameter one unit
    (as a bucket of one parameter)."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    work = [g.clone() for g in grads]
    kw = {"op": mpi_ops.Average, "process_set": None}
    with (
        mock.patch("hvdlite.torch.powersgd.mpi_ops", ALONE),
        mock.patch("hvdlite.torch.grad_compression.mpi_ops", ALONE),
        mock.patch("hvdlite.torch.topk.mpi_ops", ALONE),
        mock.patch("hvdlite.common.ops.process_set_size", lambda *_a: 1),
    ):
        exchange = VARIANTS[name]().make_exchange(params, names, kw)
        times = []
        for i in range(args.warmup + args.steps):
            for w, g in zip(work, grads):
                w.copy_(g)
            t0 = time.perf_counter()
            for j, (p, w) in enumerate(zip(params, work)):
                exchange.start(f"u{j}", [p], [w])
            exchange.finish()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1000)
        if args.profile:
            with torch.profiler.profile() as prof:
                for j, (p, w) in enumerate(zip(params, work)):
                    exchange.start(f"u{j}", [p], [w])
                exchange.finish()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="mlp", choices=("mlp", "resnet50"))
    p.add_argument("--width", type=int, default=4096, help="MLP layer width")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = shapes_of(args.shapes, args.width)
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(
        f"{args.shapes}: {len(shapes)} gradients, {numel * 4 / 2**20:.0f} MiB, "
        f"{args.threads} thread(s)"
    )
    for v in [v for v in args.variants.split(",") if v]:
        t = run_variant(v, shapes, args)
        print(f"{v:<13} median {statistics.median(t):8.1f} ms   best {min(t):8.1f} ms")


if __name__ == "__main__":
    main()
