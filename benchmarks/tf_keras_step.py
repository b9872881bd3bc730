#!/usr/bin/env python
"""Keras 3 training step at np=2: hvdlite's DistributedOptimizer vs
``tf.distribute.MultiWorkerMirroredStrategy`` on the same machine and model.

    hvdlite-run -np 2 python benchmarks/tf_keras_step.py --impl hvdlite
    hvdlite-run -np 2 python benchmarks/tf_keras_step.py --impl mwms --port 23456
    python benchmarks/tf_keras_step.py --impl local

``mwms`` does not initialise hvdlite: each rank builds ``TF_CONFIG`` from the rank the
launcher exports (HOROVOD_RANK / HOROVOD_SIZE) and ports ``--port``, ``--port + 1``, ...;
TensorFlow's own collectives (gRPC ring) reduce the gradients.  Every impl trains the same
model (a small CNN, or ``--model mlp``) with SGD on a global batch of ``--batch`` synthetic
samples (each rank ``--batch / size``) in a ``tf.function`` train step: hvdlite with
``DistributedGradientTape``, MWMS with ``strategy.run`` (Keras' optimizer all-reduces the
gradients there; ``model.fit`` under MWMS fails in Keras 3.15 with a PerReplica conversion
error, so both use a custom loop).  Rank 0 prints the median ms per step over the timed
steps (``STEP_MS <impl> <ms>``).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("hvdlite", "mwms", "local"), required=True)
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=23456)
    return p.parse_args()


def main():
    args = parse()
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    size = int(os.environ.get("HOROVOD_SIZE", "1"))
    if args.impl == "mwms":
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"localhost:{args.port + i}" for i in range(size)]},
                "task": {"type": "worker", "index": rank},
            }
        )
    # one thread per op and between ops, for every impl; read by TensorFlow at startup
    # (tf.config.threading would initialise the context before MWMS may configure it)
    os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    import numpy as np
    import tensorflow as tf
    import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy() if args.impl == "mwms" else None
    hvd = None
    if args.impl == "hvdlite":
        import hvdlite.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif args.impl == "local":
        rank, size = 0, 1

    def build():
        keras.utils.set_random_seed(0)
        if args.model == "mlp":
            layers = [
                keras.Input((256,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(10),
            ]
        else:
            layers = [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        return keras.Sequential(layers), keras.optimizers.SGD(0.01)

    shape = (256,) if args.model == "mlp" else (32, 32, 3)
    local = args.batch // size
    rng = np.random.RandomState(rank)
    x = tf.constant(rng.rand(local, *shape).astype(np.float32))
    y = tf.constant(rng.randint(0, 10, size=local))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    if args.impl == "mwms":
        with strategy.scope():
            model, opt = build()

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                # the optimizer sums the replicas' gradients: scale to the global mean
                loss = loss_fn(y, model(x, training=True)) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        @tf.function
        def step(x, y):
            strategy.run(replica_step, args=(x, y))
    else:
        model, opt = build()
        if hvd is not None:
            opt.build(model.trainable_variables)
            hvd.broadcast_variables(model.variables + list(opt.variables), root_rank=0)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if hvd is not None:
                tape = hvd.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

    times = []
    for i in range(args.steps + args.warmup):
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times[args.warmup :]) * 1e3
    if rank == 0:
        print(
            f"STEP_MS {args.impl} {ms:.2f} (model {args.model}, global batch {args.batch}, "
            f"{size} rank(s), median of {args.steps} steps)",
            flush=True,
        )
    if hvd is not None:
        hvd.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
