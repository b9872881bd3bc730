"""The data and the one-process reference every integration test trains on.

Each step's global batch is GLOBAL_BATCH samples; under N ranks each rank sees every N-th
sample of it (a DistributedSampler's share), and averaged gradients make N ranks take the
steps one process takes on the whole batch.
"""

import torch

GLOBAL_BATCH = 8
STEPS = 6
LR = 0.05
FEATURES = 4


def dataset():
    """STEPS * GLOBAL_BATCH samples of a linear rule with noise-free targets."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS * GLOBAL_BATCH, FEATURES, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) - 1.0
    return x, y


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def reference():
    """The weights after STEPS steps of SGD on the whole batches, in one process."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = dataset()
    for step in range(STEPS):
        xb, yb = (
            x[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH],
            y[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH],
        )
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xb), yb).backward()
        opt.step()
    return weights(net)


def weights(net):
    return [p.detach().flatten().tolist() for p in net.parameters()]
