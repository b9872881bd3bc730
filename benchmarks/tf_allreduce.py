#!/usr/bin/env python
"""The cost of TensorFlow's crossing into the runtime, measured beside the same allreduce of
torch buffers in the same run.

Launch with the hvdlite launcher (2 processes is the reference set-up)::

    hvdlite-run -np 2 python benchmarks/tf_allreduce.py [--workloads resnet50,tiny1000]
        [--iters N]

Workloads are those of ``benchmarks/allreduce.py`` (fp32, op = Sum). Rows (median step time on
rank 0, ranks meet in a barrier before each step):

* ``torch_buffers``  one grouped allreduce of torch buffers through ``hvdlite.common.ops``
  (what ``hvdlite.torch`` issues): the runtime alone;
* ``tf_eager``       ``hvdlite.tensorflow.grouped_allreduce`` of eager tensors;
* ``tf_function``    the same inside a ``tf.function`` (one ``tf.py_function`` node);
* ``to_buffer_only`` every tensor to a buffer (``np.asarray`` + ``torch.from_numpy``), no copy;
* ``crossing_only``  the crossing without a collective: every tensor to a buffer
  (``np.asarray`` + ``torch.from_numpy``) and a buffer of its size back
  (``tf.convert_to_tensor``), i.e. the adapter's extra work per step.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import resnet50_shapes  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402
from hvdlite.common import ops  # noqa: E402
from hvdlite.tensorflow import mpi_ops  # noqa: E402

MiB = 1024 * 1024


def shapes_of(name):
    if name == "resnet50":
        return resnet50_shapes()
    if name == "tiny1000":
        return [(256,)] * 1000
    raise SystemExit(f"unknown workload {name!r}")


def timed(rows, iters):
    """Median seconds per row; rows take turns step by step, so load drifts on a shared
    machine hit all alike."""
    times = {name: [] for name, _ in rows}
    for _ in range(iters):
        for name, step in rows:
            hvd.barrier()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="resnet50,tiny1000")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    torch.set_num_threads(1)
    hvd.init()
    for w in args.workloads.split(","):
        shapes = shapes_of(w)
        tfs = [tf.ones(s, tf.float32) for s in shapes]
        bufs = [torch.ones(s) for s in shapes]
        mb = sum(int(np.prod(s)) for s in shapes) * 4 / MiB

        def torch_step():
            outs = [torch.empty_like(b) for b in bufs]
            ops.synchronize(ops.allreduce_async(bufs, outs, None, True, ops.Sum, finish=list))

        def tf_eager():
            hvd.grouped_allreduce(tfs, op=hvd.Sum)

        fn = tf.function(lambda *xs: hvd.grouped_allreduce(list(xs), op=hvd.Sum))

        def tf_function():
            fn(*tfs)

        def to_buffers():
            for t in tfs:
                mpi_ops.to_buffer(t)

        def crossing():
            for t, b in zip(tfs, bufs):
                mpi_ops.to_buffer(t)
                mpi_ops.from_buffer(b)

        rows = [
            ("torch_buffers", torch_step),
            ("tf_eager", tf_eager),
            ("tf_function", tf_function),
            ("to_buffer_only", to_buffers),
            ("crossing_only", crossing),
        ]
        for _, step in rows:
            step()  # warm-up / trace
        res = timed(rows, args.iters)
        if hvd.rank() == 0:
            print(f"{w}: {len(shapes)} tensors, {mb:.1f} MiB, np={hvd.size()}")
            for name, _ in rows:
                ratio = res[name] / res["torch_buffers"]
                print(f"  {name:14s} {res[name] * 1e3:9.2f} ms   x{ratio:5.2f} of torch_buffers")
            sys.stdout.flush()
    hvd.shutdown()


if __name__ == "__main__":
    main()
