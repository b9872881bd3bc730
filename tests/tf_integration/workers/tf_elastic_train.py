"""A deterministic elastic TensorFlow job (driven by tests/tf_integration/test_tf_elastic.py).

The TensorFlow twin of tests/elastic/workers/elastic_train.py: step s trains a Keras model
with SGD + momentum on a global batch of 12 samples made from seed s, each rank on its shard,
in a ``tf.function`` train step with ``DistributedGradientTape``; the state is a
``TensorFlowKerasState``.  Rank 0 writes the result and a one-process full-batch reference of
the same steps to ELASTIC_OUT; they must match however many resets happened.

Environment: ELASTIC_STEPS, ELASTIC_OUT, ELASTIC_KILL_AT (``host:local_rank:step``: that worker
SIGKILLs itself at the start of that step, while the others wait in its allreduce).
"""

import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402

GLOBAL_BATCH = 12
STEPS = int(os.environ.get("ELASTIC_STEPS", "20"))


def batch(step):
    rng = np.random.RandomState(1000 + step)
    x = rng.randn(GLOBAL_BATCH, 4).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def make():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)
    return model, opt


def should_die(step):
    target = os.environ.get("ELASTIC_KILL_AT")
    if not target:
        return False
    host, local_rank, at = target.split(":")
    me = (os.environ.get("HVDLITE_HOSTNAME"), os.environ.get("HVDLITE_LOCAL_RANK"))
    return me == (host, local_rank) and step == int(at)


def step_fn(model, opt, distributed):
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return train_step


def reference():
    model, opt = make()
    train_step = step_fn(model, opt, False)
    for s in range(STEPS):
        train_step(*batch(s))
    return [w.tolist() for w in model.get_weights()]


def main():
    hvd.init()
    model, opt = make()
    train_step = step_fn(model, opt, True)
    state = hvd.elastic.TensorFlowKerasState(model, opt, step=0, history=[], sizes=[])

    def on_reset():
        print(f"RESET rank={hvd.rank()} size={hvd.size()} step={state.step}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        print(f"TRAIN rank={hvd.rank()} size={hvd.size()} step={state.step}", flush=True)
        while state.step < STEPS:
            x, y = batch(state.step)
            shard = slice(
                hvd.rank() * GLOBAL_BATCH // hvd.size(),
                (hvd.rank() + 1) * GLOBAL_BATCH // hvd.size(),
            )
            if should_die(state.step):
                os.kill(os.getpid(), signal.SIGKILL)
            train_step(x[shard], y[shard])
            state.history.append(state.step)
            state.sizes.append(hvd.size())
            state.step += 1
            state.commit()

    train(state)
    if hvd.rank() == 0 and os.environ.get("ELASTIC_OUT"):
        with open(os.environ["ELASTIC_OUT"], "w") as f:
            json.dump(
                {
                    "weights": [w.tolist() for w in model.get_weights()],
                    "reference": reference(),
                    "history": state.history,
                    "sizes": state.sizes,
                    "size": hvd.size(),
                },
                f,
            )
    print(f"DONE rank={hvd.rank()} size={hvd.size()} steps={state.step}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
