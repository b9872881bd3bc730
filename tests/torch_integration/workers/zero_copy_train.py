"""Trains a small model with DistributedOptimizer and saves what it ends with (driven by
tests/torch_integration/test_zero_copy.py), so a run with zero-copy buckets can be compared
bit by bit with one that copies them.

Environment: ZC_OUT (a directory: rank R writes rank<R>.pt, a dict by run), ZC_RUNS (the
runs, one after another in this process, the runtime restarted between them:
``ZERO_COPY:COMPRESSION[:small]``, e.g. ``1:none,0:none,1:fp16,0:fp16``; ``small``: pieces
of a few KiB), ZC_STEPS (default 6), ZC_ELASTIC (1: one run, an elastic loop with TorchState
and ZC_COMPRESSION; start it with ``--fault-at`` to force a reset), ZC_BUCKET_MB
(bucket_cap_mb, default 0.05: several buckets).  Each rank records how many reductions ran zero-copy in each rendezvous round
and how many reductions of tensors in its bucket arena did not (the shared-memory
group's ``zero_copy_`` wrapped to count, nothing else changed).
"""

import os

import torch

import hvdlite.torch as hvd
from hvdlite.common import basics
from hvdlite.common.backend import shared_buckets, shm

ZERO_COPY_BY_ROUND = {}
_zero_copy = shm.SharedMemoryGroup.zero_copy_


def _counted(self, flats, *args, **kwargs):
    done = _zero_copy(self, flats, *args, **kwargs)
    arena = shared_buckets.arena()
    if not done and (arena is None or arena.offset_of(flats[0]) < 0):
        return done  # not a bucket (the elastic state's own allreduces)
    key = basics.rendezvous_round()
    counts = ZERO_COPY_BY_ROUND.setdefault(key, [0, 0])
    counts[bool(done)] += 1
    return done


shm.SharedMemoryGroup.zero_copy_ = _counted

STEPS = int(os.environ.get("ZC_STEPS", "6"))
COMPRESSIONS = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 192),
        torch.nn.Tanh(),
        torch.nn.Linear(192, 160),
        torch.nn.Tanh(),
        torch.nn.Linear(160, 4),
    )


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def train_step(model, opt, step):
    x, y = batch(step, hvd.rank())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def train(compression, elastic):
    """Train the model from its seed; returns what the comparison needs."""
    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=COMPRESSIONS[compression],
        bucket_cap_mb=float(os.environ.get("ZC_BUCKET_MB", "0.05")),
    )
    shared = [b.shared for b in opt._hvd_buckets]
    ZERO_COPY_BY_ROUND.clear()
    if elastic:
        state = hvd.elastic.TorchState(model, opt, step=0)

        @hvd.elastic.run
        def loop(state):
            while state.step < STEPS:
                train_step(model, opt, state.step)
                state.step += 1
                state.commit()

        loop(state)
    else:
        for step in range(STEPS):
            train_step(model, opt, step)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
        "shared": shared,
        "zero_copy": dict(ZERO_COPY_BY_ROUND),
    }


#: ``small``: pieces of 5 KiB floats (slots of 20 KiB), so every bucket is many pieces
SMALL_PIECES = {"HVDLITE_FUSION_CHUNK_BYTES": "16384", "HVDLITE_INPLACE_THRESHOLD": "4096"}


def main():
    torch.set_num_threads(1)
    results = {}
    if os.environ.get("ZC_ELASTIC") == "1":
        hvd.init()
        results["elastic"] = train(os.environ.get("ZC_COMPRESSION", "none"), elastic=True)
    else:
        # each run: zero-copy on (1) or off (0), the compression, optionally small pieces;
        # the runtime restarts in between and reads the settings anew
        for run in os.environ.get("ZC_RUNS", "1:none,0:none").split(","):
            zero_copy, compression, *small = run.split(":")
            os.environ["HVDLITE_ZERO_COPY"] = zero_copy
            for k, v in SMALL_PIECES.items():
                if small:
                    os.environ[k] = v
                else:
                    os.environ.pop(k, None)
            hvd.init()
            results[run] = train(compression, elastic=False)
            hvd.shutdown()
    out = os.environ["ZC_OUT"]
    rank = int(os.environ.get("HVDLITE_RANK", "0"))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    print(
        f"DONE rank={rank} "
        + " ".join(
            f"{k}: shared={v['shared']} zero_copy={v['zero_copy']}" for k, v in results.items()
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
