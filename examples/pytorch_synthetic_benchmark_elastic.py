"""Elastic synthetic-data benchmark: Horovod's elastic example of the same name, on hvdlite.

    hvdlite-run -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        python examples/pytorch_synthetic_benchmark_elastic.py

where ``hosts.sh`` prints one ``host:slots`` line per available host.  Workers may
die or hosts come and go: the run keeps its committed state and carries on at the
new size (the learning rate follows ``hvd.size()`` through a reset callback).
"""

import argparse
import os
import sys
import timeit

import torch
import torch.nn.functional as F

import hvdlite.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import ResNetish  # noqa: E402


def main():
    p = argparse.ArgumentParser(description="hvdlite elastic PyTorch synthetic benchmark")
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression in allreduce")
    p.add_argument("--batch-size", type=int, default=16, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=64, help="square input images of this size")
    p.add_argument("--width", type=int, default=32, help="channels of the first ResNet stage")
    p.add_argument("--num-warmup-batches", type=int, default=2)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument(
        "--num-batches-per-commit",
        type=int,
        default=1,
        help="batches between commits of the elastic state",
    )
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(42)
    model = ResNetish(num_classes=1000, width=args.width)
    base_lr = 0.01
    opt = torch.optim.SGD(model.parameters(), lr=base_lr * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), compression=compression
    )

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    def benchmark_step(state):
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()
        state.batch += 1
        if state.batch == args.num_batches_per_commit:
            state.batch = 0
            state.commit()

    @hvd.elastic.run
    def run_benchmark(state):
        if not state.warm:
            log("Running warmup...")
            timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
            state.warm = True
            state.commit()
        for i in range(state.iter, args.num_iters):
            t = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
            rate = args.batch_size * args.num_batches_per_iter / t
            log(f"Iter #{i}: {rate:.1f} img/sec per rank ({hvd.size()} ranks)")
            state.img_secs.append(rate)
            state.iter = i + 1
            state.commit()

    def on_reset():
        for group in opt.param_groups:
            group["lr"] = base_lr * hvd.size()
        log(f"Reset: now {hvd.size()} ranks")

    state = hvd.elastic.TorchState(model, opt, img_secs=[], iter=0, batch=0, warm=False)
    state.register_reset_callbacks([on_reset])
    run_benchmark(state)

    rates = state.img_secs
    mean = sum(rates) / len(rates)
    dev = (sum((r - mean) ** 2 for r in rates) / len(rates)) ** 0.5
    log(f"Img/sec per rank: {mean:.1f} +-{1.96 * dev:.1f}")
    log(
        f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-"
        f"{hvd.size() * 1.96 * dev:.1f}"
    )
    hvd.shutdown()


if __name__ == "__main__":
    main()
