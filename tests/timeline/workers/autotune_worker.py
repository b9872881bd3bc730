"""Trains-alike steps under --autotune until rank 0's tuner keeps its best; writes JSON.

Each rank records, through a recorder of its own, every cycle in which it switched
parameters, and checks every allreduce result exactly.
"""

import dataclasses
import json
import sys

import torch

from hvdlite.common import basics
from hvdlite.common.diagnostics import observers
from hvdlite.common.diagnostics.recorder import Recorder
import hvdlite.torch as hvd


class Switches(Recorder):
    active = True

    def __init__(self):
        self.seen = []

    def parameters(self, cycle, params):
        self.seen.append([cycle, dataclasses.asdict(params)])


def main():
    log = Switches()
    basics.start_runtime(recorder=log)
    r, size = hvd.rank(), hvd.size()
    tuner = observers.current().autotuner if r == 0 else None
    steps = 0
    while steps < 600:
        tensors = [torch.full((50 * (i + 1),), float(r + i + steps)) for i in range(12)]
        tensors.append(torch.full((300_000,), float(r - steps)))
        flag = torch.tensor([1.0 if tuner is not None and tuner.finished.is_set() else 0.0])
        handles = [hvd.allreduce_async_(t, name=f"t{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        handles.append(hvd.allreduce_async_(flag, name="finished", op=hvd.Sum))
        for h in handles:
            hvd.synchronize(h)
        for i, t in enumerate(tensors[:-1]):
            assert torch.all(t == float(sum(q + i + steps for q in range(size)))), (steps, i)
        assert torch.all(tensors[-1] == float(sum(q - steps for q in range(size))))
        steps += 1
        if flag.item() > 0:
            break
    out = {
        "rank": r,
        "steps": steps,
        "switches": log.seen,
        "final": dataclasses.asdict(basics.runtime().params),
    }
    if tuner is not None:
        out["best"] = dataclasses.asdict(tuner.best) if tuner.best else None
        out["samples"] = len(tuner.samples)
    hvd.shutdown()
    with open(f"{sys.argv[1]}.{r}", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
