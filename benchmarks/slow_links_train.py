"""One method's training run for ``benchmarks/slow_links.py``, on every rank of an
``hvdlite-run`` job: a small character-level transformer trained on the Python standard
library's own source text (every machine has it; nothing is downloaded).

    hvdlite-run -np 4 python benchmarks/slow_links_train.py --method sync --steps 100 --json F

Every method starts from the same weights (the same seed) and every rank reads the same
batches in every method (its own generator, seeded by the rank).  Rank 0 keeps the clock:
training time only, the validation passes between steps excluded (every rank waits for
them).  A DiLoCo run is evaluated on its anchors, the model every rank agrees on, right
after the outer steps that change them.  It writes one JSON object (rank 0): the method, the
steps taken, the training seconds, the seconds rank 0 spent in forward and backward, the
bytes its host's link sent per rank per step, and the validation curve
``[[seconds, step, loss], ...]``.
"""

import argparse
import copy
import glob
import json
import math
import os
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdlite.torch as hvd

VOCAB = 256  # bytes
#: the ways to train, as benchmarks/slow_links.py names them
METHODS = (
    "sync",
    "powersgd",
    "int8",
    "diloco-h10",
    "diloco-h50",
    "diloco-streaming",
    "diloco-h50-int8",
)


def corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's top-level modules' source, in name order, as bytes."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(bytearray(data[:max_bytes]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    """A GPT-style byte-level language model."""

    def __init__(self, width: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def loss_of(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


class Data:
    """Training windows from the first 90 % of the text, each rank its own random ones;
    a fixed validation set from the last 10 %."""

    def __init__(self, args, rank: int):
        text = corpus(args.corpus_bytes)
        cut = int(len(text) * 0.9)
        self.train, self.val_text = text[:cut], text[cut:]
        self.batch, self.context = args.batch, args.context
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
        g = torch.Generator().manual_seed(args.seed)
        starts = torch.randint(
            0, len(self.val_text) - self.context - 1, (args.val_windows,), generator=g
        )
        self.val = self._windows(self.val_text, starts)

    def _windows(self, text, starts):
        rows = torch.stack([text[s : s + self.context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def next(self):
        starts = torch.randint(
            0, len(self.train) - self.context - 1, (self.batch,), generator=self.gen
        )
        return self._windows(self.train, starts)


def optimizer_for(method: str, model, lr: float):
    """The method's optimizer, and the steps between its evaluations' model changes."""
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    named = model.named_parameters()
    if method == "sync":
        return hvd.DistributedOptimizer(inner, named_parameters=named), 1
    if method == "powersgd":
        comp = hvd.Compression.powersgd(rank=4, start_iter=10)
        return hvd.DistributedOptimizer(inner, named_parameters=named, compression=comp), 1
    if method == "int8":
        comp = hvd.Compression.int8()
        return hvd.DistributedOptimizer(inner, named_parameters=named, compression=comp), 1
    settings = {
        "diloco-h10": dict(sync_every=10),
        "diloco-h50": dict(sync_every=50),
        "diloco-streaming": dict(sync_every=50, fragments=5, overlap=True),
        "diloco-h50-int8": dict(sync_every=50, compression=hvd.Compression.int8()),
    }[method]
    opt = hvd.DiLoCo(model, inner, **settings)
    return opt, settings["sync_every"] // settings.get("fragments", 1)


def tx_bytes():
    """What this host's link has sent (the testbed's hosts have one interface, eth0)."""
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


@torch.no_grad()
def validate(model, opt, data) -> float:
    """The validation loss of the model every rank agrees on (DiLoCo: its anchors)."""
    if isinstance(opt, hvd.DiLoCo):
        model = copy.deepcopy(model)
        for p, a in zip((p for p in model.parameters() if p.requires_grad), opt.anchors):
            p.copy_(a)
    model.eval()
    x, y = data.val
    losses = [loss_of(model, x[i : i + 16], y[i : i + 16]).item() for i in range(0, len(x), 16)]
    model.train()
    return sum(losses) / len(losses)


def train(args) -> dict:
    torch.manual_seed(args.seed)
    model = CharLM(args.width, args.layers, args.heads, args.context)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt, period = optimizer_for(args.method, model, args.lr)
    data = Data(args, hvd.rank())
    every = max(args.eval_every, period) if period > 1 else args.eval_every
    trained = compute = 0.0
    curve = [[0.0, 0, validate(model, opt, data)]]
    tx0, step = tx_bytes(), 0
    while True:
        t0 = time.perf_counter()
        for g in opt.param_groups:  # a short linear warm-up, then constant
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        x, y = data.next()
        opt.zero_grad()
        loss_of(model, x, y).backward()
        t1 = time.perf_counter()
        opt.step()
        step += 1
        trained += time.perf_counter() - t0
        compute += t1 - t0
        if step % every:
            continue
        curve.append([trained, step, validate(model, opt, data) if hvd.rank() == 0 else math.nan])
        done = step >= args.steps or trained >= args.budget_s
        if hvd.broadcast(torch.tensor([int(done)]), 0, name="slow_links.done").item():
            break
    sent = None if tx0 is None else (tx_bytes() - tx0) / hvd.local_size() / step
    return dict(
        method=args.method,
        steps=step,
        train_seconds=trained,
        compute_seconds=compute,
        bytes_per_step=sent,
        curve=curve,
        params=sum(p.numel() for p in model.parameters()),
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--steps", type=int, default=10**9, help="stop after this many steps")
    p.add_argument("--budget-s", type=float, default=math.inf, help="stop after this much training")
    p.add_argument("--eval-every", type=int, default=10, help="steps between validations")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=4 << 20)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--json", metavar="FILE", help="rank 0 writes its result here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    result = train(args)
    if hvd.rank() == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
