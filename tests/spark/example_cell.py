"""The notebook cell of docs/clusters.md (Spark section), as the tests run it."""


def train(scale):
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    out = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
           "local_size": hvd.local_size(), "total": total * scale}
    hvd.shutdown()
    return out


def fails_on_rank_1():
    import hvdlite.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one refuses")
    return hvd.rank()


def elastic_train(steps, kill_at):
    """tests/elastic's deterministic training; the worker that started on slot
    ``kill_at[:2]`` SIGKILLs its own Python worker during step ``kill_at[2]``."""
    import os
    import hvdlite.torch as hvd
    from tests.elastic.workers.elastic_train import run_training
    hvd.init()
    me = (os.environ["HVDLITE_HOSTNAME"], int(os.environ["HVDLITE_LOCAL_RANK"]))
    model, state = run_training(steps, 0.1, lambda step: (*me, step) == tuple(kill_at))
    out = {"rank": hvd.rank(), "size": hvd.size(), "slot": list(me), "sizes": state.sizes,
           "weight": model.weight.detach().view(-1).tolist(),
           "bias": model.bias.detach().tolist(), "history": state.history}
    hvd.shutdown()
    return out
