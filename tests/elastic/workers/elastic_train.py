"""A deterministic elastic training job (driven by tests/elastic).

Step s trains on a global batch of 12 samples made from seed s; each rank takes
its shard (12 divides evenly over 1, 2, 3, 4 and 6 ranks), so with averaged
gradients every step's update is the same whatever the world size: the final
weights must equal a one-process run of the same steps, however many resets
happened.  ``state.history`` records every committed step, so a lost or repeated
step shows up.

Environment: ELASTIC_STEPS (default 30), ELASTIC_OUT (rank 0 writes the result
there as JSON), ELASTIC_KILL_AT (``host:local_rank:step``: that worker SIGKILLs
itself during that step's gradient allreduce), ELASTIC_STEP_SLEEP (seconds per
step, so hosts can come and go while training runs), ELASTIC_SLEEP_WHILE (a path:
sleep only while it exists, so a test can end the slow part when it is done),
ELASTIC_HOLD_GIL (``host:local_rank:step:seconds``: that worker holds the interpreter
lock that long before that step's backward pass, so its background thread cannot run),
ELASTIC_DEADLOCK (``host:local_rank:step``: that worker deadlocks on a lock of its own
before that step's backward pass, interpreter lock free, until it is killed),
ELASTIC_DILOCO (H: train with ``hvd.DiLoCo``, plain SGD inside, an outer step every H
steps, committed only then; the result equals :func:`diloco_reference` when the world keeps
its size, and ``state.outer`` records each committed outer step).
"""

import ctypes
import json
import os
import signal
import threading
import time

import torch

import hvdlite.torch as hvd

GLOBAL_BATCH = 12
STEPS = int(os.environ.get("ELASTIC_STEPS", "30"))
SLEEP_S = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
SLEEP_WHILE = os.environ.get("ELASTIC_SLEEP_WHILE")
DILOCO_H = int(os.environ.get("ELASTIC_DILOCO", "0"))


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    return x, y


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def should_die(step: int) -> bool:
    target = os.environ.get("ELASTIC_KILL_AT")
    if not target:
        return False
    host, local_rank, at = target.split(":")
    me = (os.environ.get("HVDLITE_HOSTNAME"), os.environ.get("HVDLITE_LOCAL_RANK"))
    return me == (host, local_rank) and step == int(at)


def hold_gil(step: int) -> None:
    """Block this process, interpreter lock held (a long C call would), if asked to."""
    target = os.environ.get("ELASTIC_HOLD_GIL")
    if not target:
        return
    host, local_rank, at, seconds = target.split(":")
    me = (os.environ.get("HVDLITE_HOSTNAME"), os.environ.get("HVDLITE_LOCAL_RANK"))
    if me == (host, local_rank) and step == int(at):
        print(f"HOLDING the GIL for {seconds}s at step {step}", flush=True)
        ctypes.PyDLL(None).usleep(int(float(seconds) * 1e6))  # PyDLL: the lock stays held


def deadlock(step: int) -> None:
    """Wait forever for a lock this thread holds (a deadlock in user code), if asked to."""
    target = os.environ.get("ELASTIC_DEADLOCK")
    if not target:
        return
    host, local_rank, at = target.split(":")
    me = (os.environ.get("HVDLITE_HOSTNAME"), os.environ.get("HVDLITE_LOCAL_RANK"))
    if me == (host, local_rank) and step == int(at):
        print(f"DEADLOCKED at step {step}", flush=True)
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()


def still_slow() -> bool:
    return SLEEP_WHILE is None or os.path.exists(SLEEP_WHILE)


def run_training(steps=STEPS, sleep_s=SLEEP_S, die=should_die, slow=still_slow):
    """Build the model and run the elastic loop (after ``hvd.init()``); ``die(step)`` says
    whether this worker kills itself during that step's gradient allreduce, ``slow()``
    whether a step still sleeps ``sleep_s``."""
    torch.set_num_threads(1)
    model = make_model()
    if DILOCO_H:
        opt = hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), DILOCO_H)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0, history=[], sizes=[], resets=0, outer=[])

    def on_reset():
        state.resets += 1
        print(f"RESET rank={hvd.rank()} size={hvd.size()} step={state.step}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        print(f"TRAIN rank={hvd.rank()} size={hvd.size()} step={state.step}", flush=True)
        while state.step < steps:
            x, y = batch(state.step)
            shard = slice(
                hvd.rank() * GLOBAL_BATCH // hvd.size(),
                (hvd.rank() + 1) * GLOBAL_BATCH // hvd.size(),
            )
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
            hold_gil(state.step)
            deadlock(state.step)
            loss.backward()  # gradient allreduce starts here
            if die(state.step):
                os.kill(os.getpid(), signal.SIGKILL)
            opt.step()
            state.history.append(state.step)
            state.sizes.append(hvd.size())
            state.step += 1
            if sleep_s and slow():
                time.sleep(sleep_s)
            if not DILOCO_H or state.step % DILOCO_H == 0:
                if DILOCO_H:
                    state.outer.append(opt.outer_steps)
                state.commit()

    train(state)
    return model, state


def main():
    hvd.init()
    model, state = run_training()
    if hvd.rank() == 0 and os.environ.get("ELASTIC_OUT"):
        with open(os.environ["ELASTIC_OUT"], "w") as f:
            json.dump(
                {
                    "weight": model.weight.detach().view(-1).tolist(),
                    "bias": model.bias.detach().tolist(),
                    "history": state.history,
                    "sizes": state.sizes,
                    "size": hvd.size(),
                    "outer": state.outer,
                },
                f,
            )
    print(f"DONE rank={hvd.rank()} size={hvd.size()} steps={state.step}", flush=True)
    hvd.shutdown()


def reference(steps: int = STEPS):
    """The same steps in one process on the full batch: what every elastic run must reach."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.weight.detach().view(-1).tolist(), model.bias.detach().tolist()


def diloco_reference(steps: int, h: int, size: int):
    """DiLoCo on ``size`` ranks simulated in one process: each rank's SGD on its shard for
    ``h`` steps, then the default outer step (Nesterov SGD, lr 0.7, momentum 0.9) on the
    averaged change."""
    anchor = make_model()
    outer = torch.optim.SGD(anchor.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for first in range(0, steps, h):
        moved = []
        for rank in range(size):
            local = make_model()
            local.load_state_dict(anchor.state_dict())
            inner = torch.optim.SGD(local.parameters(), lr=0.05)
            for step in range(first, first + h):
                x, y = batch(step)
                shard = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
                inner.zero_grad()
                torch.nn.functional.mse_loss(local(x[shard]), y[shard]).backward()
                inner.step()
            moved.append([p.detach() for p in local.parameters()])
        for i, p in enumerate(anchor.parameters()):
            p.grad = p.detach() - sum(m[i] for m in moved) / size
        outer.step()
    return anchor.weight.detach().view(-1).tolist(), anchor.bias.detach().tolist()


if __name__ == "__main__":
    main()
