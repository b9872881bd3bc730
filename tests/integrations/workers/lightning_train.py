"""A LightningModule trained by ``Trainer(strategy=STRATEGY)`` under hvdlite-run; prints
``WEIGHTS [...]`` and the averaged ``LOSS`` Lightning logged with sync_dist."""

import json
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvdlite.lightning  # noqa: F401  (registers strategy="hvdlite")
from common import GLOBAL_BATCH, LR, dataset, model, weights


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def main():
    strategy = sys.argv[1]
    size = int(sys.argv[2])
    x, y = dataset()
    data = TensorDataset(x, y)
    # each rank every size-th sample in order (Lightning's own sampler would shuffle), so
    # that the ranks' batches together are the one-process run's
    sampler = DistributedSampler(
        data, num_replicas=size, rank=int(os.environ["RANK"]), shuffle=False
    )
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // size, sampler=sampler)
    module = Regression()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=size if strategy == "ddp" else 1,
        max_epochs=1,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    print("WEIGHTS " + json.dumps(weights(module.net)), flush=True)
    print(f"LOSS {float(trainer.callback_metrics['loss']):.6f}", flush=True)


if __name__ == "__main__":
    main()
