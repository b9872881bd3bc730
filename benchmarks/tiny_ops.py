#!/usr/bin/env python
"""Tiny-op latency: 1000 small allreduces per step, separate and grouped.

Launch with the hvdlite launcher (2 processes is the reference set-up)::

    hvdlite-run -np 2 python benchmarks/tiny_ops.py [--tensors 1000] [--floats 256]
        [--steps 20] [--rounds 3] [--json FILE]

Two step kinds, interleaved round by round so they see the same machine load:

* ``separate``  ``hvd.allreduce_async_(t, name=...)`` for every tensor, then
  ``hvd.synchronize`` on every handle (what an optimizer without buckets does);
* ``grouped``   one ``hvd.grouped_allreduce_(tensors, name=...)`` call;
* ``torch_flat`` the baseline: one raw ``torch.distributed`` Gloo allreduce of the same bytes
  pre-flattened into one tensor (the transport's limit: no per-op cost at all).  Every row
  shows its ratio to it (``x flat``; target: ``separate`` at most 4x).

The hvdlite kinds use ``op=hvd.Average``, as ``DistributedOptimizer`` does.  Every step starts after an
untimed barrier; rank 0 times the step.  Only rank 0 prints: median, min and mean ms per step
of each kind over all rounds, the ratio to ``torch_flat``, the per-round medians, and the
machine's load average before and after (numbers from a loaded machine are not comparable).

``--barrier raw`` (the default) meets on a torch.distributed Gloo group of its own, outside
hvdlite, as ``allreduce.py`` does; ``--barrier hvd`` meets in ``hvd.barrier()`` (what earlier
versions did; both measure the same within noise).  ``allreduce.py``'s ``tiny1000`` row runs
a flat Gloo allreduce and a memcpy of the same bytes between its hvdlite steps (its paired
columns), which leaves the caches cold and costs the hvdlite step 0.5-0.9 ms more than here;
``allreduce.py --no-paired`` measures what this script does.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

import hvdlite.torch as hvd


def step_separate(tensors, names):
    handles = [hvd.allreduce_async_(t, name=n) for t, n in zip(tensors, names)]
    for h in handles:
        hvd.synchronize(h)


def step_grouped(tensors, names):
    hvd.grouped_allreduce_(tensors, name="tiny.grouped")


def step_torch_flat(tensors, names):
    """The baseline: one raw ``torch.distributed`` allreduce of all the bytes, pre-flattened
    (``names`` is that flat tensor here)."""
    import torch.distributed as dist

    dist.all_reduce(names)


STEPS = {"separate": step_separate, "grouped": step_grouped, "torch_flat": step_torch_flat}
#: issue 37's target: separate ops at most this many times one flat torch allreduce
TARGET_X_FLAT = 4.0


def raw_barrier():
    """A barrier that leaves hvdlite alone: a torch.distributed Gloo group of its own (set up
    by ``allreduce.py``'s :func:`init_raw_group`, on a port of its own)."""
    import torch.distributed as dist
    from allreduce import init_raw_group  # benchmarks/ is the script's directory

    init_raw_group(hvd.rank(), hvd.size())
    flag = torch.ones(1)
    return lambda: dist.all_reduce(flag)


def time_steps(kind, tensors, names, steps, barrier):
    """Rank 0's seconds per step of ``kind`` (each after an untimed ``barrier()``)."""
    fn = STEPS[kind]
    out = []
    for _ in range(steps):
        barrier()
        t0 = time.perf_counter()
        fn(tensors, names)
        out.append(time.perf_counter() - t0)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=1000, help="tensors per step")
    p.add_argument("--floats", type=int, default=256, help="fp32 elements per tensor")
    p.add_argument("--steps", type=int, default=20, help="timed steps per kind per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per kind first")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument(
        "--kinds",
        default="separate,grouped,torch_flat",
        help="comma-separated step kinds (torch_flat: the baseline every row is "
        "divided by, always run)",
    )
    p.add_argument(
        "--barrier",
        choices=("raw", "hvd"),
        default="raw",
        help="what the ranks meet in before each step: a Gloo group outside hvdlite "
        "(raw, default) or hvd.barrier() (see the module docstring)",
    )
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in STEPS:
            raise SystemExit(f"tiny_ops.py: unknown --kinds entry {k!r} (known: {list(STEPS)})")
    if "torch_flat" not in kinds:
        kinds.append("torch_flat")
    load_start = os.getloadavg()
    hvd.init()
    tensors = [torch.ones(args.floats) for _ in range(args.tensors)]
    names = [f"tiny.{i}" for i in range(args.tensors)]
    raw = raw_barrier()  # the raw group also runs the torch_flat baseline
    barrier = raw if args.barrier == "raw" else hvd.barrier
    flat = torch.ones(args.tensors * args.floats)
    step_args = {k: (tensors, flat if k == "torch_flat" else names) for k in kinds}
    for k in kinds:
        time_steps(k, *step_args[k], args.warmup, barrier)
    per_round = {k: [] for k in kinds}
    pooled = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            times = time_steps(k, *step_args[k], args.steps, barrier)
            per_round[k].append(statistics.median(times) * 1e3)
            pooled[k] += times
    rows = {
        k: {
            "median_ms": statistics.median(pooled[k]) * 1e3,
            "min_ms": min(pooled[k]) * 1e3,
            "mean_ms": statistics.mean(pooled[k]) * 1e3,
            "round_medians_ms": [round(v, 3) for v in per_round[k]],
        }
        for k in kinds
    }
    # the ratio to the flat baseline: its median, and the median of per-round ratios
    base = rows["torch_flat"]
    for k, r in rows.items():
        r["x_flat"] = r["median_ms"] / base["median_ms"]
        r["x_flat_rounds"] = statistics.median(
            a / b for a, b in zip(r["round_medians_ms"], base["round_medians_ms"])
        )
    targets = {}
    if "separate" in rows:
        v = rows["separate"]["x_flat"]
        targets["separate_x_torch_flat"] = {
            "value": v,
            "target": f"<= {TARGET_X_FLAT:g}",
            "met": v <= TARGET_X_FLAT,
        }
    load_end = os.getloadavg()
    # every rank starts from ones and averages: anything else is a wrong result
    values_ok = bool(torch.cat(tensors).eq(1).all().item())
    if hvd.rank() == 0:
        print(
            f"np={hvd.size()} tensors={args.tensors} floats={args.floats} "
            f"steps={args.steps}x{args.rounds} barrier={args.barrier} values_ok={values_ok} "
            f"load {load_start[0]:.2f} -> {load_end[0]:.2f} on {os.cpu_count()} cores"
        )
        for k, r in rows.items():
            print(
                f"{k:10s} median {r['median_ms']:7.3f} ms  min {r['min_ms']:7.3f}  "
                f"mean {r['mean_ms']:7.3f}  x flat {r['x_flat']:5.2f} "
                f"(per round {r['x_flat_rounds']:5.2f})  rounds {r['round_medians_ms']}"
            )
        for name, t in targets.items():
            print(
                f"target {name}: {t['value']:.2f} (want {t['target']}) -> "
                f"{'MET' if t['met'] else 'MISSED'}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "np": hvd.size(),
                        "args": vars(args),
                        "rows": rows,
                        "targets": targets,
                        "values_ok": values_ok,
                        "load": {"start": load_start, "end": load_end, "cores": os.cpu_count()},
                    },
                    f,
                    indent=1,
                )
    import torch.distributed as dist

    dist.destroy_process_group()
    hvd.shutdown()
    return 0 if values_ok else 1


if __name__ == "__main__":
    sys.exit(main())
