"""Gradient compression at np=2 over TCP: bytes each rank sends per step, step time, and the
loss of a small classifier, for none / fp16 / PowerSGD rank 1 and 4 / top-k 1%.

    hvdlite-run -np 2 --no-shared-memory python benchmarks/compression.py [--json out.json]

``--no-shared-memory`` makes the two ranks talk over TCP (loopback), standing in for a
network link between hosts; with shared memory on one host compression mostly adds compute.

* ``mlp``: a 4-layer MLP of ``--width``-wide layers (4096: 67 M parameters, 256 MiB of
  gradients), forward + backward + step on a small batch;
* ``resnet50``: the 161 gradient tensors of ResNet-50 (shapes from
  ``benchmarks/allreduce.py``), each step a backward pass that yields fixed gradients, so
  the step is the reduction (communication + compression) alone;
* ``classifier``: a small MLP classifier on synthetic data (a fixed random teacher network
  labels Gaussian inputs, each rank its own samples) trained ``--train-steps`` steps with
  each variant from the same start; the final loss is the mean of the last 20 steps.

A ``local`` row times the same step without communication (each rank alone): ``step -
local`` is what exchanging the gradients costs, compression included.

All variants live in the same job and are timed interleaved, round by round, so machine noise
hits them alike; the tables give medians and ratios to ``none`` from the same run.  Bytes
are the payload each rank hands to the collectives per step (from the shapes; a ring
allreduce puts about twice that on the wire, an allgather ``size - 1`` times).
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import hvdlite.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import resnet50_shapes  # noqa: E402

VARIANTS = {
    "none": lambda: hvd.Compression.none,
    "fp16": lambda: hvd.Compression.fp16,
    "powersgd-r1": lambda: hvd.Compression.powersgd(rank=1, start_iter=0),
    "powersgd-r4": lambda: hvd.Compression.powersgd(rank=4, start_iter=0),
    "topk-1%": lambda: hvd.Compression.topk(ratio=0.01),
}
#: the row of steps without communication: the compute every variant shares
LOCAL = "local"
#: the classifier keeps PowerSGD's default warm-up (uncompressed steps first)
TRAIN_VARIANTS = dict(
    VARIANTS,
    **{
        "powersgd-r1": lambda: hvd.Compression.powersgd(rank=1, start_iter=10),
        "powersgd-r4": lambda: hvd.Compression.powersgd(rank=4, start_iter=10),
    },
)


def payload_bytes(spec, shapes, itemsize=4) -> int:
    """Bytes one rank hands to the collectives per step for gradients of ``shapes``."""
    total = 0
    for shape in shapes:
        p = torch.empty(shape, device="meta")
        numel = p.numel()
        if spec is hvd.Compression.none:
            total += numel * itemsize
        elif spec is hvd.Compression.fp16:
            total += numel * 2
        elif spec.kind == "powersgd":
            mat = spec.matrix_shape(p)
            total += itemsize * (numel if mat is None else (mat[0] + mat[1]) * mat[2])
        else:
            total += (
                numel * itemsize if numel < spec.min_numel else spec.k_of(numel) * (itemsize + 4)
            )
    return total


class _Fixed(torch.nn.Module):
    """Parameters of the given shapes; ``loss()`` has the fixed gradients ``grads``."""

    def __init__(self, shapes):
        super().__init__()
        gen = torch.Generator().manual_seed(hvd.rank())
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in shapes)
        self.grads = [torch.randn(s, generator=gen) for s in shapes]

    def loss(self):
        return sum((p * g).sum() for p, g in zip(self.ps, self.grads))


def mlp_workload(args):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    return model, lambda m: F.mse_loss(m(x), y)


def resnet_workload(_args):
    model = _Fixed(resnet50_shapes())
    return model, lambda m: m.loss()


def make_step(model, loss_fn, spec, lr=1e-4):
    """One training step with ``spec`` (``None``: no DistributedOptimizer, no communication)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if spec is not None:
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), compression=spec
        )

    def step():
        opt.zero_grad()
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def time_workload(name, build, args, variants):
    """Median step time (ms) per variant, interleaved, and the payload bytes per step.
    ``local`` is the same step without any communication (each rank alone)."""
    model, loss_fn = build(args)
    shapes = [tuple(p.shape) for p in model.parameters()]
    steps, specs = {}, {}
    variants = [LOCAL] + variants
    for v in variants:
        specs[v] = None if v == LOCAL else VARIANTS[v]()
        steps[v] = make_step(copy.deepcopy(model), loss_fn, specs[v])
        for _ in range(args.warmup):
            steps[v]()
    del model
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            for _ in range(args.steps):
                hvd.barrier()
                t0 = time.perf_counter()
                steps[v]()
                hvd.barrier()  # a step is done when every rank is done
                times[v].append((time.perf_counter() - t0) * 1000)
    rows = {}
    for v in variants:
        rows[v] = {
            "bytes": 0 if v == LOCAL else payload_bytes(specs[v], shapes),
            "step_ms": statistics.median(times[v]),
            "samples": len(times[v]),
        }
    return {"params": sum(torch.Size(s).numel() for s in shapes), "rows": rows}


def train_classifier(args, variants):
    """Final loss (mean of the last 20 steps) per variant, all from the same start."""
    gen = torch.Generator().manual_seed(1234)
    teacher = torch.randn(64, 10, generator=gen)
    data = torch.Generator().manual_seed(100 + hvd.rank())
    torch.manual_seed(0)
    base = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    batches = []
    for _ in range(args.train_steps):
        x = torch.randn(64, 64, generator=data)
        batches.append((x, (x @ teacher).argmax(1)))
    out = {}
    for v in variants:
        model = copy.deepcopy(base)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(),
            compression=TRAIN_VARIANTS[v](),
        )
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        mine = torch.tensor(losses[-20:]).mean()
        out[v] = {
            "final_loss": hvd.allreduce(mine, name=f"loss.{v}").item(),
            "first_loss": losses[0],
        }
    return out


def print_tables(results):
    for name, res in results["timing"].items():
        base = res["rows"]["none"]
        local = res["rows"][LOCAL]["step_ms"]
        print(
            f"\n{name} ({res['params'] / 1e6:.1f} M parameters), np={results['size']}, "
            f"medians of {base['samples']} steps; exchange = step - local step"
        )
        print(
            f"{'variant':<13}{'MiB/step':>10}{'bytes vs none':>15}{'step ms':>10}"
            f"{'speed-up':>10}{'exchange ms':>13}"
        )
        for v, row in res["rows"].items():
            print(
                f"{v:<13}{row['bytes'] / 2**20:>10.2f}{row['bytes'] / base['bytes']:>15.4f}"
                f"{row['step_ms']:>10.1f}{base['step_ms'] / row['step_ms']:>10.2f}"
                f"{row['step_ms'] - local:>13.1f}"
            )
    if results.get("classifier"):
        base = results["classifier"]["none"]["final_loss"]
        print(
            "\nclassifier: final loss (mean of the last 20 of "
            f"{results['train_steps']} steps, averaged over ranks)"
        )
        for v, row in results["classifier"].items():
            print(
                f"{v:<13}{row['final_loss']:>10.4f}  ratio to none {row['final_loss'] / base:.3f}"
            )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="mlp,resnet50")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--width", type=int, default=4096, help="MLP layer width")
    p.add_argument("--batch", type=int, default=8, help="MLP batch size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: cores / local ranks)"
    )
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    hvd.init()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size()))
    variants = [v for v in args.variants.split(",") if v]
    if "none" not in variants:
        variants.insert(0, "none")
    builders = {"mlp": mlp_workload, "resnet50": resnet_workload}
    results = {"size": hvd.size(), "train_steps": args.train_steps, "timing": {}}
    for w in [w for w in args.workloads.split(",") if w]:
        results["timing"][w] = time_workload(w, builders[w], args, variants)
    if args.train_steps > 0:
        results["classifier"] = train_classifier(args, variants)
    if hvd.rank() == 0:
        print_tables(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    hvd.shutdown()


if __name__ == "__main__":
    main()
