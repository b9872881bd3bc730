"""The deterministic elastic training of tests/elastic, as a function for RayExecutor.

Each step trains on a global batch of 12 from seed ``step``, sharded over the ranks, so
the final weights equal a one-process run whatever the resets (tests/elastic's
reference).  ``kill_at`` = ``(host, local_rank, step)``: that worker's process dies
during that step's gradient allreduce; with ``sleep_below_size`` a step sleeps ``sleep_s``
only while the world is smaller than that (the rest run at full speed once it grew);
``trained_file`` is created once a step is done.
"""

import os


def train(steps=30, sleep_s=0.0, kill_at=None, sleep_below_size=None, trained_file=None):
    import hvdlite.torch as hvd
    from tests.elastic.workers.elastic_train import run_training

    hvd.init()
    me = (os.environ.get("HVDLITE_HOSTNAME"), int(os.environ.get("HVDLITE_LOCAL_RANK", -1)))

    def slow():
        if trained_file:  # a step is done: the test may now grow the world
            open(trained_file, "a").close()
        return sleep_below_size is None or hvd.size() < sleep_below_size

    model, state = run_training(
        steps,
        sleep_s,
        lambda step: kill_at is not None and (me[0], me[1], step) == tuple(kill_at),
        slow,
    )
    out = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "host": me[0],
        "weight": model.weight.detach().view(-1).tolist(),
        "bias": model.bias.detach().tolist(),
        "history": state.history,
        "sizes": state.sizes,
    }
    hvd.shutdown()
    return out
