"""The deterministic elastic training of tests/elastic, as a function for RayExecutor.

Each step trains on a global batch of 12 from seed ``step``, sharded over the ranks, so
the final weights equal a one-process run whatever the resets (tests/elastic's
reference).  ``kill_at`` = ``(host, local_rank, step)``: that worker's process dies
during that step's gradient allreduce.
"""

import os
import signal
import time


def train(steps=30, sleep_s=0.0, kill_at=None):
    import torch
    import hvdlite.torch as hvd
    from tests.elastic.workers.elastic_train import GLOBAL_BATCH, batch, make_model

    torch.set_num_threads(1)
    hvd.init()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, history=[], sizes=[])
    me = (os.environ.get("HVDLITE_HOSTNAME"), int(os.environ.get("HVDLITE_LOCAL_RANK", -1)))

    @hvd.elastic.run
    def loop(state):
        while state.step < steps:
            x, y = batch(state.step)
            shard = slice(hvd.rank() * GLOBAL_BATCH // hvd.size(),
                          (hvd.rank() + 1) * GLOBAL_BATCH // hvd.size())
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
            if kill_at is not None and (me[0], me[1], state.step) == tuple(kill_at):
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            state.history.append(state.step)
            state.sizes.append(hvd.size())
            state.step += 1
            if sleep_s:
                time.sleep(sleep_s)
            state.commit()

    loop(state)
    out = {"rank": hvd.rank(), "size": hvd.size(), "host": me[0],
           "weight": model.weight.detach().view(-1).tolist(),
           "bias": model.bias.detach().tolist(), "history": state.history,
           "sizes": state.sizes}
    hvd.shutdown()
    return out
