"""Synthetic-data throughput of a ResNet-style CNN trained with hvdlite (images/sec).

    hvdlite-run -np 2 python examples/pytorch_synthetic_benchmark.py --batch-size 16

Flags follow Horovod's example of the same name.
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
    p = argparse.ArgumentParser(description="hvdlite PyTorch synthetic benchmark")
    p.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression in allreduce")
    p.add_argument("--batch-size", type=int, default=16, help="input batch size per rank")
    p.add_argument("--image-size", type=int, default=64, help="square input images of this size")
    p.add_argument("--width", type=int, default=32, help="channels of the first ResNet stage")
    p.add_argument("--num-warmup-batches", type=int, default=2)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument(
        "--use-adasum",
        action="store_true",
        help="reduce with Adasum (power-of-two ranks; no learning-rate scaling)",
    )
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    torch.manual_seed(42)
    model = ResNetish(num_classes=1000, width=args.width)
    # Adasum combines the ranks' updates adaptively, so the learning rate is not scaled
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * (1 if args.use_adasum else hvd.size()))
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(
        opt,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))

    def benchmark_step():
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    log(
        f"Model: ResNet-style (width {args.width}), batch size {args.batch_size}, "
        f"{args.image_size}x{args.image_size} images, {hvd.size()} rank(s)"
    )
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{i}: {rate:.1f} img/sec per rank")
        rates.append(rate)
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
