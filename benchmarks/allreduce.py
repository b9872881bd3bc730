#!/usr/bin/env python
"""Allreduce benchmark: hvdlite against raw torch.distributed, in the same run.

Launch with the hvdlite launcher (2 processes is the reference set-up)::

    hvdlite-run -np 2 python benchmarks/allreduce.py [--workloads resnet50,tiny1000]
        [--iters N] [--warmup N] [--json FILE]

Workloads (all fp32; hvdlite rows use ``--op``, default Average as ``DistributedOptimizer``
does; the raw torch.distributed rows sum):

* ``resnet50``  the 161 parameter tensors of torchvision's ResNet-50 (25.56 M params, 97.5 MiB),
  shapes generated from the architecture by :func:`resnet50_shapes`;
* ``bert``      BERT-base gradients (embeddings, 12 encoder layers, pooler; 199 tensors, ~109.5 M
  params, ~418 MiB); ``--bert-layers`` shrinks it;
* ``tiny1000``  1000 tensors of 256 floats (1000 KiB in all);
* ``big64mb``   one 64 MiB tensor;
* ``msg<BYTES>`` a message of BYTES bytes split into up to 16 equal tensors (at least 256 B
  each), e.g. ``msg4096`` or ``msg268435456``: the message-size sweep of ``report.py``.

Implementations:

* ``hvdlite_fusion``   every tensor ``hvd.allreduce_async_(t, name=..., op=hvd.Sum)``, then
  ``hvd.synchronize`` on every handle (what an optimizer does); fusion threshold from the
  environment (default 128 MiB);
* ``hvdlite_optimizer`` one step's gradient exchange of ``hvd.DistributedOptimizer`` over
  parameters of the workload's shapes (its default buckets, zero-copy on: the buckets live
  in the host's shared arena): ``optimizer.step()`` of an optimizer whose own update does
  nothing, so the step is ``synchronize()`` alone;
* ``hvdlite_optimizer_copy`` (opt-in) the same with ``HVDLITE_ZERO_COPY=0`` (buckets in
  private memory, copied through the shared segment);
* ``hvdlite_nofusion`` the same with ``HVDLITE_FUSION_THRESHOLD=0`` (runtime restarted);
* ``hvdlite_noshm``    ``hvdlite_fusion`` with ``HVDLITE_SHARED_MEMORY=0``: ranks on one host
  exchange through Gloo's TCP loopback instead of shared memory (runtime restarted);
* ``torch_per_tensor`` raw ``torch.distributed`` (its own Gloo group on a separate TCP port),
  ``all_reduce(t, async_op=True)`` for every tensor, then ``wait()`` on all;
* ``torch_per_tensor_sync`` the same, one blocking ``all_reduce`` at a time;
* ``torch_flat``       one ``all_reduce`` of a single pre-flattened tensor holding all the bytes:
  the limit of this transport (no packing cost at all);
* ``memcpy_floor``     every rank copies its own bytes of the workload at the same time
  (``dst.copy_(src)`` over the same tensor set, after the same barrier): an allreduce in place must
  at least read its input and write its output, so no transport can beat this.  Every row reports
  its ratio to it (``x floor``; ``paired floor``: a floor step timed right after each hvdlite step);
* ``hvdlite_timeline`` (opt-in) ``hvdlite_fusion`` with ``hvd.start_timeline`` writing a trace
  the whole time: its ratio to ``hvdlite_fusion`` in the same run is the timeline's cost;
* ``hvdlite_noflight`` (opt-in) ``hvdlite_fusion`` with the flight recorder off
  (``HVDLITE_FLIGHT_RECORDER_SIZE=0``): ``hvdlite_fusion`` over it is the recorder's cost;
* ``hvdlite_metrics`` (opt-in) ``hvdlite_fusion`` with the ranks counting and sending their
  counters every second, as under ``hvdlite-run --metrics-port``: its ratio to
  ``hvdlite_fusion`` in the same run is the metrics' cost;
* ``hvdlite_autotune`` (opt-in) ``hvdlite_fusion`` with the parameters ``--autotune`` chose: the
  first round tunes on ``--autotune-workload`` (untimed) until rank 0 keeps its best, every
  round then runs with those parameters.

Each (workload, impl) cell is timed step by step: all ranks meet in a barrier on the raw group
(outside the timed region), then rank 0 times one step.  The hvdlite runtime is shut down while
the raw torch.distributed implementations run, so its background thread cannot take CPU from
them.  Each hvdlite step is followed by a timed ``torch_flat`` step (``paired`` column: the median
of the per-step ratios, robust to the load swings of a shared 2-core machine).

Only rank 0 prints.  ``--json FILE`` writes every row plus the run's settings.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import hvdlite.torch as hvd

MiB = 1024 * 1024

# --------------------------------------------------------------------------------------------
# workloads


def resnet50_shapes():
    """Parameter shapes of torchvision's resnet50 in ``named_parameters()`` order (161)."""
    shapes = []

    def conv(cout, cin, k):
        shapes.append((cout, cin, k, k))

    def bn(c):
        shapes.append((c,))  # weight
        shapes.append((c,))  # bias

    conv(64, 3, 7)
    bn(64)
    inplanes = 64
    expansion = 4
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            conv(planes, inplanes, 1)
            bn(planes)
            conv(planes, planes, 3)
            bn(planes)
            conv(planes * expansion, planes, 1)
            bn(planes * expansion)
            if b == 0:  # downsample: stride or channel change in the first block of each stage
                conv(planes * expansion, inplanes, 1)
                bn(planes * expansion)
            inplanes = planes * expansion
    shapes.append((1000, 2048))  # fc.weight
    shapes.append((1000,))  # fc.bias
    return shapes


def bert_base_shapes(
    layers=12, hidden=768, intermediate=3072, vocab=30522, max_pos=512, type_vocab=2
):
    """Parameter shapes of BERT-base (HF ``BertModel`` with pooler) in definition order."""
    shapes = [(vocab, hidden), (max_pos, hidden), (type_vocab, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _qkv in range(3):  # query, key, value
            shapes += [(hidden, hidden), (hidden,)]
        shapes += [(hidden, hidden), (hidden,)]  # attention.output.dense
        shapes += [(hidden,), (hidden,)]  # attention.output.LayerNorm
        shapes += [(intermediate, hidden), (intermediate,)]  # intermediate.dense
        shapes += [(hidden, intermediate), (hidden,)]  # output.dense
        shapes += [(hidden,), (hidden,)]  # output.LayerNorm
    shapes += [(hidden, hidden), (hidden,)]  # pooler.dense
    return shapes


def workload_shapes(name, args):
    if name == "resnet50":
        return resnet50_shapes()
    if name == "bert":
        return bert_base_shapes(layers=args.bert_layers)
    if name == "tiny1000":
        return [(256,)] * 1000
    if name == "big64mb":
        return [(64 * MiB // 4,)]
    if is_msg(name):
        total = int(name[3:]) // 4
        parts = max(1, min(16, total // 64))
        return [(total // parts,)] * parts
    raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


WORKLOADS = ("resnet50", "bert", "tiny1000", "big64mb")
#: default (warmup, iters) per workload, sized so a full default run at np=2 on the 2-core
#: machine stays around three minutes; --warmup / --iters override them all.
DEFAULT_ITERS = {"resnet50": (3, 15), "bert": (1, 5), "tiny1000": (3, 60), "big64mb": (2, 10)}
IMPLS = (
    "hvdlite_fusion",
    "hvdlite_optimizer",
    "hvdlite_nofusion",
    "hvdlite_noshm",
    "torch_per_tensor",
    "torch_per_tensor_sync",
    "torch_flat",
    "memcpy_floor",
)
#: run only when named in --impls (they cost a trace file / a tuning phase)
OPT_IN_IMPLS = (
    "hvdlite_timeline",
    "hvdlite_autotune",
    "hvdlite_noflight",
    "hvdlite_metrics",
    "hvdlite_optimizer_copy",
)
ALL_IMPLS = IMPLS + OPT_IN_IMPLS
RAW_IMPLS = ("torch_per_tensor", "torch_per_tensor_sync", "torch_flat", "memcpy_floor")
#: always run: every row is reported as a ratio to these
REFERENCE_IMPLS = ("torch_flat", "memcpy_floor")


def is_msg(name):
    return name.startswith("msg") and name[3:].isdigit() and int(name[3:]) >= 4


def default_iters(name):
    """(warmup, iters) of a workload: its table entry, or by size for ``msg<BYTES>``."""
    if name in DEFAULT_ITERS:
        return DEFAULT_ITERS[name]
    nbytes = int(name[3:])
    return (1, 3) if nbytes >= 128 * MiB else (1, 5) if nbytes >= 16 * MiB else (2, 10)


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------------------------
# the raw torch.distributed group


def init_raw_group(rank, size):
    """A default torch.distributed Gloo group on its own TCP port (not hvdlite's rendezvous).

    MASTER_ADDR / MASTER_PORT from the environment are used when both are set; otherwise rank 0
    opens a TCPStore on a free port and tells the others the port through hvdlite (broadcast).
    """
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    timeout = datetime.timedelta(seconds=120)
    if addr and port:
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size, timeout=timeout
        )
        return
    addr = "127.0.0.1"  # single-host benchmark
    store = None
    port_t = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        store = dist.TCPStore(
            addr, 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        port_t[0] = store.port
    hvd.broadcast_(port_t, root_rank=0, name="bench.raw_port")
    if rank != 0:
        store = dist.TCPStore(addr, int(port_t[0]), size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


_FLAG = None


def barrier_and_decide(rank, go_on):
    """All ranks meet; returns rank 0's decision (True = run another step)."""
    global _FLAG
    if _FLAG is None:
        _FLAG = torch.ones(1, dtype=torch.int32)
    _FLAG[0] = 1 if (rank != 0 or go_on) else 0
    dist.all_reduce(_FLAG, op=dist.ReduceOp.MIN)
    return bool(_FLAG[0])


# --------------------------------------------------------------------------------------------
# one step of each implementation


#: the reduction of the hvdlite rows (``--op``)
HVD_OP = {"average": hvd.Average, "sum": hvd.Sum}
_OP = [hvd.Average]


def step_hvdlite(tensors, names):
    """Returns the seconds spent enqueueing (the rest of the step is waiting on handles)."""
    op = _OP[0]
    t0 = time.perf_counter()
    handles = [hvd.allreduce_async_(t, name=n, op=op) for t, n in zip(tensors, names)]
    enqueued = time.perf_counter() - t0
    for h in handles:
        hvd.synchronize(h)
    return enqueued


class _NoUpdate(torch.optim.SGD):
    """An optimizer whose update does nothing: its DistributedOptimizer's step() is the
    gradient exchange alone."""

    def step(self, closure=None):
        return None


def make_optimizer(shapes, workload):
    """A DistributedOptimizer over parameters of ``shapes`` (default buckets) after one
    untimed step; returns it and the gradients (its bucket views, all ones)."""
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = hvd.DistributedOptimizer(
        _NoUpdate(params, lr=0.0),
        named_parameters=[(f"bench.{workload}.{i}", p) for i, p in enumerate(params)],
    )
    opt.step()
    return opt, [p.grad for p in params]


def step_hvdlite_optimizer(tensors, opt):
    opt.step()


def step_torch_per_tensor(tensors, names):
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()


def step_torch_per_tensor_sync(tensors, names):
    for t in tensors:
        dist.all_reduce(t)


def step_torch_flat(tensors, names):
    dist.all_reduce(tensors[0])


def step_memcpy_floor(tensors, copies):
    """Each rank copies its own bytes once (the peers do the same at the same time)."""
    for dst, src in zip(copies, tensors):
        dst.copy_(src)


STEPS = {
    "hvdlite_fusion": step_hvdlite,
    "hvdlite_nofusion": step_hvdlite,
    "hvdlite_noshm": step_hvdlite,
    "hvdlite_timeline": step_hvdlite,
    "hvdlite_autotune": step_hvdlite,
    "hvdlite_noflight": step_hvdlite,
    "hvdlite_metrics": step_hvdlite,
    "hvdlite_optimizer": step_hvdlite_optimizer,
    "hvdlite_optimizer_copy": step_hvdlite_optimizer,
    "torch_per_tensor": step_torch_per_tensor,
    "torch_per_tensor_sync": step_torch_per_tensor_sync,
    "torch_flat": step_torch_flat,
    "memcpy_floor": step_memcpy_floor,
}


def run_cell(impl, workload, shapes, warmup, iters, budget_s, min_steps, rank, size, paired=False):
    """Times ``warmup`` + up to ``iters`` steps (fewer, but at least ``min_steps``, if over
    ``budget_s``).  Returns this rank's step times in seconds (rank 0's are reported), the
    enqueue part of each step (hvdlite only) and, with ``paired``, a ``torch_flat`` step and a
    ``memcpy_floor`` step timed right after each step (so they see the same machine load)."""
    total = sum(numel(s) for s in shapes)
    if impl == "torch_flat":
        tensors = [torch.ones(total, dtype=torch.float32)]
    else:
        tensors = [torch.ones(s, dtype=torch.float32) for s in shapes]
    flat = [torch.ones(total, dtype=torch.float32)] if paired else None
    floor_src = [torch.ones(s, dtype=torch.float32) for s in shapes] if paired else None
    floor_dst = [torch.empty_like(t) for t in floor_src] if paired else None
    if impl == "memcpy_floor":
        names = [torch.empty_like(t) for t in tensors]  # the copies' destinations
    elif impl.startswith("hvdlite_optimizer"):
        names, tensors = make_optimizer(shapes, workload)  # the optimizer and its gradients
    else:
        names = [f"bench.{workload}.{i}" for i in range(len(tensors))]
    step = STEPS[impl]
    # what one step multiplies every element by: a sum by the world size, an average by 1
    grows = (
        size
        if impl.startswith("torch") or (impl.startswith("hvdlite") and _OP[0] == hvd.Sum)
        else 1
    )
    expected = 1.0
    out = {"times": [], "enqueue": [], "paired_flat": [], "paired_floor": []}
    started = time.perf_counter()
    i = 0
    while True:
        if i >= warmup:
            timed = i - warmup
            go_on = timed < iters and (
                timed < min_steps or time.perf_counter() - started < budget_s
            )
        else:
            go_on = True
        if i % 40 == 39:  # keep values far from overflow (Sum grows by size per step)
            for t in tensors + (flat or []):
                t.fill_(1.0)
            expected = 1.0
        if not barrier_and_decide(rank, go_on):
            break
        t0 = time.perf_counter()
        enq = step(tensors, names)
        dt = time.perf_counter() - t0
        if paired:
            barrier_and_decide(rank, True)
            t1 = time.perf_counter()
            step_torch_flat(flat, None)
            dt_flat = time.perf_counter() - t1
            barrier_and_decide(rank, True)
            t1 = time.perf_counter()
            step_memcpy_floor(floor_src, floor_dst)
            dt_floor = time.perf_counter() - t1
        expected *= grows
        if i == 0:
            # one correctness check per cell: every element of the first and last tensor
            checks = [(tensors[0], expected), (tensors[-1], expected)]
            if paired:
                checks.append((flat[0], float(size)))
            for t, want in checks:
                if not torch.all(t == want):
                    raise RuntimeError(
                        f"rank {rank}: {impl} on {workload}: wrong result (expected {want}, "
                        f"got values in [{t.min().item()}, {t.max().item()}])"
                    )
        if i >= warmup:
            out["times"].append(dt)
            if enq is not None:
                out["enqueue"].append(enq)
            if paired:
                out["paired_flat"].append(dt_flat)
                out["paired_floor"].append(dt_floor)
        i += 1
    del tensors, flat, floor_src, floor_dst
    return out


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )
    p.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help=f"comma-separated subset of {','.join(ALL_IMPLS)} (default: "
        f"{','.join(IMPLS)}; torch_flat and memcpy_floor are always run since ratios "
        f"refer to them)",
    )
    p.add_argument(
        "--op",
        choices=sorted(HVD_OP),
        default="average",
        help="the reduction of the hvdlite rows (default average, as "
        "DistributedOptimizer reduces gradients; raw torch rows always sum)",
    )
    p.add_argument(
        "--timeline-file",
        default=None,
        help="hvdlite_timeline: where the trace goes (default: a temporary file)",
    )
    p.add_argument(
        "--autotune-workload",
        default="resnet50",
        help="hvdlite_autotune: the workload tuned on (default resnet50)",
    )
    p.add_argument(
        "--autotune-samples",
        type=int,
        default=12,
        help="hvdlite_autotune: --autotune-bayes-opt-max-samples (default 12)",
    )
    p.add_argument(
        "--autotune-steps",
        type=int,
        default=3,
        help="hvdlite_autotune: --autotune-steps-per-sample (default 3)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed steps per cell (default per workload: "
        + ", ".join(f"{k} {v[1]}" for k, v in DEFAULT_ITERS.items())
        + ")",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps per cell (default per workload: "
        + ", ".join(f"{k} {v[0]}" for k, v in DEFAULT_ITERS.items())
        + ")",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=8.0,
        help="stop a cell's timed steps early after about this many seconds (split "
        "over the rounds; at least 3 steps are always timed; default 8)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="split each cell's steps over this many interleaved rounds of all "
        "implementations, so slow drifts in machine load hit all alike "
        "(default 3)",
    )
    p.add_argument(
        "--no-paired",
        dest="paired",
        action="store_false",
        help="do not time a torch_flat step next to each hvdlite step (those pairs "
        "give a ratio to the flat limit that machine-load swings mostly cancel "
        "out of; that flat step runs while hvdlite's idle loop is alive)",
    )
    p.add_argument("--verbose", action="store_true", help="print each cell as it finishes")
    p.add_argument(
        "--bert-layers",
        type=int,
        default=12,
        help="encoder layers of the BERT workload (default 12 = BERT-base)",
    )
    p.add_argument("--json", metavar="FILE", help="write all rows and settings as JSON")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    for w in args.workloads:
        if w not in WORKLOADS and not is_msg(w):
            p.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in ALL_IMPLS:
            p.error(f"unknown impl {i!r}; choose from {', '.join(IMPLS)}")
    impls += [i for i in REFERENCE_IMPLS if i not in impls]
    args.impls = [i for i in ALL_IMPLS if i in impls]
    if "hvdlite_autotune" in args.impls and args.autotune_workload not in args.workloads:
        p.error(f"--autotune-workload {args.autotune_workload} is not among --workloads")
    for flag in ("iters", "warmup"):
        v = getattr(args, flag)
        if v is not None and v < (1 if flag == "iters" else 0):
            p.error(f"--{flag} must be >= {1 if flag == 'iters' else 0}")
    if args.bert_layers < 0:
        p.error("--bert-layers must be >= 0")
    return args


#: the live parameters a tuned run sets through the environment (restored afterwards)
TUNED_VARS = (
    "HVDLITE_FUSION_THRESHOLD",
    "HVDLITE_FUSION_CHUNK_BYTES",
    "HVDLITE_INPLACE_THRESHOLD",
    "HVDLITE_CYCLE_TIME",
    "HVDLITE_CACHE_CAPACITY",
    "HVDLITE_AUTOTUNE",
    "HVDLITE_AUTOTUNE_WARMUP_SAMPLES",
    "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE",
    "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HVDLITE_SHARED_MEMORY",
    "HVDLITE_FLIGHT_RECORDER_SIZE",
    "HVDLITE_METRICS_PORT",
    "HVDLITE_ZERO_COPY",
)
_LAUNCH_ENV = {k: os.environ.get(k) for k in TUNED_VARS}


def restart_hvdlite(fusion_threshold, extra_env=None):
    """shutdown -> set HVDLITE_FUSION_THRESHOLD (None: the launcher's) and ``extra_env``, the
    other tuned variables back to the launcher's -> init."""
    if hvd.is_initialized():
        hvd.shutdown()
    env = dict(_LAUNCH_ENV)
    if fusion_threshold is not None:
        env["HVDLITE_FUSION_THRESHOLD"] = str(fusion_threshold)
    env.update(extra_env or {})
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    hvd.init()


def tune(args, shapes, rank):
    """Runs steps of the tuned workload under --autotune until rank 0 keeps its best; returns
    (environment that sets those parameters, a description, seconds spent, samples)."""
    from hvdlite.common import basics
    from hvdlite.common.diagnostics import observers

    restart_hvdlite(
        None,
        {
            "HVDLITE_AUTOTUNE": "1",
            "HVDLITE_AUTOTUNE_WARMUP_SAMPLES": "1",
            "HVDLITE_AUTOTUNE_STEPS_PER_SAMPLE": str(args.autotune_steps),
            "HVDLITE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": str(args.autotune_samples),
        },
    )
    tuner = observers.current().autotuner if rank == 0 else None
    w = args.autotune_workload
    tensors = [torch.ones(s, dtype=torch.float32) for s in shapes[w]]
    names = [f"bench.{w}.{i}" for i in range(len(tensors))]
    t0 = time.perf_counter()
    extra = 3  # steps after the decision, so every rank has switched to the best
    while barrier_and_decide(rank, extra > 0):
        step_hvdlite(tensors, names)
        for t in tensors:
            t.fill_(1.0)
        if tuner is None or tuner.finished.is_set():
            extra -= 1
    elapsed = time.perf_counter() - t0
    p = basics.runtime().params
    env = {
        "HVDLITE_FUSION_THRESHOLD": str(p.fusion_threshold_bytes),
        "HVDLITE_FUSION_CHUNK_BYTES": str(p.fusion_chunk_bytes),
        "HVDLITE_INPLACE_THRESHOLD": str(p.inplace_threshold_bytes),
        "HVDLITE_CYCLE_TIME": str(p.cycle_time_ms),
        "HVDLITE_CACHE_CAPACITY": "1024" if p.cache_enabled else "0",
    }
    samples = len(tuner.samples) if tuner is not None else None
    hvd.shutdown()
    return env, str(p), elapsed, samples


def main(argv=None):
    args = parse_args(argv)
    _OP[0] = HVD_OP[args.op]
    load_start = os.getloadavg()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if size < 2 and rank == 0:
        print(
            "note: running with 1 process; launch with hvdlite-run -np 2 for real numbers",
            file=sys.stderr,
        )
    init_raw_group(rank, size)
    from hvdlite.common import basics

    fusion_cfg = basics.config().fusion_threshold_bytes
    cycle_ms = basics.config().cycle_time_ms

    shapes = {w: workload_shapes(w, args) for w in args.workloads}
    iters = {
        w: (
            default_iters(w)[0] if args.warmup is None else args.warmup,
            default_iters(w)[1] if args.iters is None else args.iters,
        )
        for w in args.workloads
    }

    # phases: raw torch.distributed with hvdlite shut down, then hvdlite with each fusion setting
    phases = [("raw", [i for i in args.impls if i in RAW_IMPLS], False)]
    # each hvdlite phase: (fusion threshold or None for the launch's, extra variables)
    variants = {
        "hvdlite_fusion": (None, {}),
        "hvdlite_nofusion": (0, {}),
        "hvdlite_noshm": (None, {"HVDLITE_SHARED_MEMORY": "0"}),
        "hvdlite_timeline": (None, {}),
        "hvdlite_autotune": (None, {}),
        "hvdlite_noflight": (None, {"HVDLITE_FLIGHT_RECORDER_SIZE": "0"}),
        # the ranks count and send to the store as under --metrics-port (the
        # launcher serves nothing unless that flag is given)
        "hvdlite_metrics": (None, {"HVDLITE_METRICS_PORT": "1"}),
        "hvdlite_optimizer": (None, {}),
        "hvdlite_optimizer_copy": (None, {"HVDLITE_ZERO_COPY": "0"}),
    }
    for impl, restart in variants.items():
        if impl in args.impls:
            phases.append((impl, [impl], restart))
    timeline_file = args.timeline_file or os.path.join(
        tempfile.gettempdir(), f"hvdlite-bench-timeline-{os.getpid()}.json"
    )
    tuned = None  # (env, description, seconds, samples) once tuned

    # Load on this machine changes over seconds (other jobs share its 2 cores), so every phase is
    # run in ``--rounds`` rounds, interleaved, and the steps of all rounds are pooled.  Restarting
    # hvdlite costs ~30 ms.  The first round runs the full warm-up, later ones one step (the
    # restarted runtime has an empty response cache).
    results = {}
    enqueue = {}  # hvdlite: seconds of each step spent in the allreduce_async_ calls
    paired = {}  # hvdlite: (step, adjacent torch_flat step) pairs
    round_medians = {}
    t_start = time.perf_counter()
    rounds = max(1, args.rounds)
    for rnd in range(rounds):
        for phase, impls, overrides in phases:
            if overrides is False:
                if hvd.is_initialized():
                    hvd.shutdown()
            elif phase == "hvdlite_autotune":
                if tuned is None:
                    tuned = tune(args, shapes, rank)
                restart_hvdlite(None, tuned[0])
            else:
                restart_hvdlite(*overrides)
            if phase == "hvdlite_timeline":
                hvd.start_timeline(timeline_file)
            for w in args.workloads:
                warmup, n = iters[w]
                share = -(-n // rounds) if rnd < n % rounds or n % rounds == 0 else n // rounds
                if share == 0:
                    continue
                for impl in impls:
                    cell = run_cell(
                        impl,
                        w,
                        shapes[w],
                        warmup if rnd == 0 else min(1, warmup),
                        share,
                        args.max_seconds / rounds,
                        -(-3 // rounds),
                        rank,
                        size,
                        paired=impl.startswith("hvdlite") and args.paired,
                    )
                    times = cell["times"]
                    results.setdefault((w, impl), []).extend(times)
                    enqueue.setdefault((w, impl), []).extend(cell["enqueue"])
                    paired.setdefault((w, impl), []).extend(
                        zip(times, cell["paired_flat"], cell["paired_floor"])
                    )
                    round_medians.setdefault((w, impl), []).append(1e3 * statistics.median(times))
                    if rank == 0 and args.verbose:
                        print(
                            f"  round {rnd + 1}/{rounds} {w:>9s} {impl:<22s} "
                            f"{1e3 * statistics.median(times):9.2f} ms (n={len(times)})",
                            flush=True,
                        )
            if phase == "hvdlite_timeline":
                hvd.stop_timeline()
        if rank == 0:
            print(
                f"round {rnd + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True
            )
    elapsed = time.perf_counter() - t_start
    if hvd.is_initialized():
        hvd.shutdown()

    rows = []
    for w in args.workloads:
        nbytes = 4 * sum(numel(s) for s in shapes[w])
        flat = statistics.median(results[(w, "torch_flat")])
        floor = statistics.median(results[(w, "memcpy_floor")])
        per_tensor = results.get((w, "torch_per_tensor"))
        per_tensor = statistics.median(per_tensor) if per_tensor else None
        for impl in args.impls:
            times = results[(w, impl)]
            med = statistics.median(times)
            rows.append(
                {
                    "workload": w,
                    "impl": impl,
                    "tensors": len(shapes[w]),
                    "bytes": nbytes,
                    "iters": len(times),
                    "warmup": iters[w][0],
                    "ms_median": 1e3 * med,
                    "ms_mean": 1e3 * statistics.mean(times),
                    "ms_min": 1e3 * min(times),
                    "ms_max": 1e3 * max(times),
                    "round_medians_ms": round_medians[(w, impl)],
                    "gb_per_s": nbytes / med / 1e9,
                    "ratio_to_flat": med / flat,
                    "ratio_to_floor": med / floor,
                    "speedup_vs_per_tensor": (per_tensor / med) if per_tensor else None,
                }
            )
            enq, pairs = enqueue.get((w, impl)), paired.get((w, impl))
            if enq:
                rows[-1]["ms_enqueue_median"] = 1e3 * statistics.median(enq)
            if pairs:
                rows[-1]["paired_flat_ms_median"] = 1e3 * statistics.median(f for _, f, _ in pairs)
                rows[-1]["paired_ratio_to_flat"] = statistics.median(h / f for h, f, _ in pairs)
                rows[-1]["paired_floor_ms_median"] = 1e3 * statistics.median(c for _, _, c in pairs)
                rows[-1]["paired_ratio_to_floor"] = statistics.median(h / c for h, _, c in pairs)

    if rank == 0:
        print_table(rows, size, fusion_cfg, cycle_ms, elapsed, args.op)
        print(
            f"machine load (1-min average) {load_start[0]:.2f} before, "
            f"{os.getloadavg()[0]:.2f} after, {os.cpu_count()} cores: the physical limit "
            f"here is memcpy_floor (x floor); compare runs only on a quiet machine"
        )
        if tuned is not None:
            print(
                f"autotuned on {args.autotune_workload} in {tuned[2]:.1f} s "
                f"({tuned[3]} samples): {tuned[1]}"
            )
        if args.json:
            meta = {
                "size": size,
                "torch": torch.__version__,
                "python": platform.python_version(),
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "fusion_threshold_bytes": fusion_cfg,
                "cycle_time_ms": cycle_ms,
                "op": args.op,
                "bert_layers": args.bert_layers,
                "rounds": args.rounds,
                "max_seconds": args.max_seconds,
                "elapsed_s": elapsed,
                "argv": sys.argv[1:],
                "load_before": load_start,
                "load_after": os.getloadavg(),
            }
            if tuned is not None:
                meta["autotuned"] = {
                    "parameters": tuned[1],
                    "tuning_s": tuned[2],
                    "samples": tuned[3],
                    "env": tuned[0],
                }
            if "hvdlite_timeline" in args.impls:
                meta["timeline_file"] = timeline_file
                meta["timeline_bytes"] = os.path.getsize(timeline_file)
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows, "targets": targets(rows)}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


#: issue 23's targets: hvdlite_fusion over the concurrent-memcpy floor (paired when there)
FLOOR_TARGETS = {"resnet50": 1.5, "bert": 1.5, "big64mb": 1.4}


def targets(rows):
    """The issue's two targets, where the run has the rows to check them."""
    by = {(r["workload"], r["impl"]): r for r in rows}
    out = {}
    r = by.get(("resnet50", "hvdlite_fusion"))
    if r:
        out["resnet50_fusion_ratio_to_flat"] = {
            "value": r["ratio_to_flat"],
            "target": "<= 1.25",
            "met": r["ratio_to_flat"] <= 1.25,
        }
        if r.get("paired_ratio_to_flat"):
            v = r["paired_ratio_to_flat"]
            out["resnet50_fusion_paired_ratio_to_flat"] = {
                "value": v,
                "target": "<= 1.25",
                "met": v <= 1.25,
            }
    for w, want in FLOOR_TARGETS.items():
        r = by.get((w, "hvdlite_fusion"))
        if r:
            v = r.get("paired_ratio_to_floor") or r["ratio_to_floor"]
            out[f"{w}_fusion_ratio_to_floor"] = {
                "value": v,
                "target": f"<= {want}",
                "met": v <= want,
            }
    for w in sorted({r["workload"] for r in rows}):
        base = by.get((w, "hvdlite_fusion"))
        tl, at = by.get((w, "hvdlite_timeline")), by.get((w, "hvdlite_autotune"))
        off = by.get((w, "hvdlite_noflight"))
        if base and off:
            v = _same_run_ratio(base, off)
            out[f"{w}_flight_recorder_overhead_ratio"] = {
                "value": v,
                "target": "<= 1.03",
                "met": v <= 1.03,
            }
        if base and tl:
            v = _same_run_ratio(tl, base)
            out[f"{w}_timeline_overhead_ratio"] = {
                "value": v,
                "target": "<= 1.05",
                "met": v <= 1.05,
            }
        if at:
            v = at.get("paired_ratio_to_flat") or at["ratio_to_flat"]
            out[f"{w}_autotune_paired_ratio_to_flat"] = {
                "value": v,
                "target": "<= 1.10",
                "met": v <= 1.10,
            }
        if base and at:
            v = _same_run_ratio(at, base)
            out[f"{w}_autotune_vs_defaults"] = {"value": v, "target": "<= 1.0", "met": v <= 1.0}
    r, raw = by.get(("tiny1000", "hvdlite_fusion")), by.get(("tiny1000", "torch_per_tensor"))
    raw_sync = by.get(("tiny1000", "torch_per_tensor_sync"))
    if r and (raw or raw_sync):
        for key, base in (("vs_async", raw), ("vs_sync", raw_sync)):
            if base:
                v = base["ms_median"] / r["ms_median"]
                out[f"tiny1000_fusion_speedup_{key}"] = {
                    "value": v,
                    "target": ">= 30",
                    "met": v >= 30,
                }
    return out


def _same_run_ratio(row, base):
    """``row`` against ``base`` in this run: through their paired torch_flat steps when both
    have them (load swings cancel), else the ratio of medians."""
    if row.get("paired_ratio_to_flat") and base.get("paired_ratio_to_flat"):
        return row["paired_ratio_to_flat"] / base["paired_ratio_to_flat"]
    return row["ms_median"] / base["ms_median"]


def print_table(rows, size, fusion_cfg, cycle_ms, elapsed, op="average"):
    print()
    print(
        f"allreduce benchmark: np={size}, fp32, hvdlite op={op}, fusion threshold "
        f"{fusion_cfg / MiB:g} MiB, cycle {cycle_ms:g} ms, {elapsed:.0f} s"
    )
    head = (
        f"{'workload':<10s} {'impl':<22s} {'tensors':>7s} {'MiB':>7s} {'n':>3s} "
        f"{'ms/step':>9s} {'mean':>9s} {'min':>9s} {'GB/s':>7s} {'x flat':>7s} "
        f"{'paired':>7s} {'x floor':>7s} {'p floor':>7s} {'vs per-t':>8s} "
        f"{'enqueue':>8s}"
    )
    print(head)
    print("-" * len(head))
    last = None
    for r in rows:
        if last is not None and r["workload"] != last:
            print()
        last = r["workload"]
        sp = r["speedup_vs_per_tensor"]
        pr = r.get("paired_ratio_to_flat")
        pf = r.get("paired_ratio_to_floor")
        enq = r.get("ms_enqueue_median")
        print(
            f"{r['workload']:<10s} {r['impl']:<22s} {r['tensors']:>7d} "
            f"{r['bytes'] / MiB:>7.1f} {r['iters']:>3d} {r['ms_median']:>9.2f} "
            f"{r['ms_mean']:>9.2f} {r['ms_min']:>9.2f} {r['gb_per_s']:>7.3f} "
            f"{r['ratio_to_flat']:>7.2f} {(f'{pr:.2f}' if pr else '-'):>7s} "
            f"{r['ratio_to_floor']:>7.2f} {(f'{pf:.2f}' if pf else '-'):>7s} "
            f"{(f'{sp:.1f}x' if sp else '-'):>8s} {(f'{enq:.2f}' if enq else '-'):>8s}"
        )
    print()
    print(
        "ms/step = median per step (rank 0), n steps pooled over the rounds; GB/s = algorithmic "
        "bytes / median;\nx flat = median / torch_flat median; paired = median over steps of "
        "(hvdlite step / torch_flat step timed right after it);\nx floor / p floor = the same against "
        "memcpy_floor (every rank copying its own bytes at once);\nvs per-t = torch_per_tensor "
        "median / median; enqueue = median ms of a step spent in the allreduce_async_ calls"
    )
    for k, v in targets(rows).items():
        print(
            f"target {k}: {v['value']:.2f} (want {v['target']}) -> "
            f"{'MET' if v['met'] else 'MISSED'}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
