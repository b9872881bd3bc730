"""A training loop written for Hugging Face accelerate, under hvdlite-run; prints
``WEIGHTS [...]`` (the model after training) and the number of processes."""

import json

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from common import GLOBAL_BATCH, LR, STEPS, dataset, model, weights


def main():
    accelerator = Accelerator(cpu=True)
    x, y = dataset()
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // accelerator.num_processes)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    net, opt, loader = accelerator.prepare(net, opt, loader)
    for step, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(net(xb), yb))
        opt.step()
    assert step == STEPS - 1
    print(f"PROCESSES {accelerator.num_processes}", flush=True)
    print("WEIGHTS " + json.dumps(weights(accelerator.unwrap_model(net))), flush=True)


if __name__ == "__main__":
    main()
