"""A tiny BERT (built from a config: nothing downloaded) trained by transformers' Trainer
under hvdlite-run; prints ``WEIGHTS <sum> <first values>`` of the trained model."""

import gc
import json
import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    """Random token sequences labelled by whether token 3 occurs: learnable, fixed."""

    def __init__(self, count=64, length=12):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(4, 32, (count, length), generator=g)
        self.ids[::2, 5] = 3
        self.labels = (self.ids == 3).any(dim=1).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main():
    out_dir = sys.argv[1]
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=2,
        max_position_embeddings=16,
    )
    model = BertForSequenceClassification(config)
    initial = float(torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum())
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=Tokens()).train()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    print(f"WORLD {args.world_size} INIT {initial!r}", flush=True)
    print("WEIGHTS " + json.dumps([float(flat.double().sum()), flat[:4].tolist()]), flush=True)
    # the Trainer's DDP model sits in reference cycles: collected here, its Gloo group is
    # not freed as the interpreter ends, where torch 2.13 aborts now and then
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
