"""Train a small CNN on generated MNIST-shaped data with hvdlite.

    hvdlite-run -np 2 python examples/pytorch_mnist.py --epochs 2

Nothing is downloaded: the data set is ten fixed random 28x28 "digit" templates; each
sample is a template, randomly shifted by up to 2 pixels, plus pixel noise.  Train and test
sets come from different seeds.  Each rank trains on its shard of the training set
(DistributedSampler-style), the model and optimizer start from rank 0's state, metrics are
averaged over ranks, and rank 0 writes a checkpoint after every epoch.
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvdlite.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MnistNet  # noqa: E402


def make_dataset(n, seed, noise=0.6):
    templates = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234)) > 0.7
    templates = templates.float()
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels]
    shifts = torch.randint(-2, 3, (n, 2), generator=g)
    images = torch.stack(
        [torch.roll(img, (int(dy), int(dx)), dims=(1, 2)) for img, (dy, dx) in zip(images, shifts)]
    )
    images = images + noise * torch.randn(images.shape, generator=g)
    return TensorDataset((images - 0.3) / 0.6, labels)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def main():
    p = argparse.ArgumentParser(description="hvdlite MNIST-shaped example")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size per rank")
    p.add_argument("--test-batch-size", type=int, default=500)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05, help="learning rate per rank")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-size", type=int, default=6000)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument(
        "--checkpoint",
        default=os.path.join(tempfile.gettempdir(), "hvdlite_mnist_checkpoint.pt"),
        help="written by rank 0 after every epoch ('' disables)",
    )
    args = p.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    train_set = make_dataset(args.train_size, seed=1)
    test_set = make_dataset(args.test_size, seed=2)
    # each rank reads its own shard; rank/size come from hvdlite
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    test_sampler = DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler)

    model = MnistNet()
    # scale the learning rate with the number of ranks (the global batch grows with it)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )

    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(
                    f"Train epoch {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]"
                    f"\tloss {loss.item():.4f}",
                    flush=True,
                )

    def test():
        model.eval()
        loss_sum, correct, count = 0.0, 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                out = model(data)
                loss_sum += F.nll_loss(out, target, reduction="sum").item()
                correct += out.argmax(1).eq(target).sum().item()
                count += len(target)
        loss = metric_average(loss_sum / count, "avg_loss")
        acc = metric_average(correct / count, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set: average loss {loss:.4f}, accuracy {100 * acc:.2f}%", flush=True)
        return acc

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        acc = test()
        if hvd.rank() == 0 and args.checkpoint:
            torch.save(
                {
                    "epoch": epoch,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "accuracy": acc,
                },
                args.checkpoint,
            )
            print(f"Checkpoint written to {args.checkpoint} (epoch {epoch})", flush=True)
    if hvd.rank() == 0:
        print(f"FINAL_ACCURACY {acc:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
