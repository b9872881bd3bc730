#!/usr/bin/env python
"""Keras 3 on MNIST-shaped data with hvdlite (no download): each of 10 classes is a fixed random
28x28 pattern plus noise, so a small CNN learns it in a few epochs.

    hvdlite-run -np 2 python examples/tensorflow2_keras_mnist.py --epochs 3

Every rank trains on its shard of the data; DistributedOptimizer averages the gradients,
BroadcastGlobalVariablesCallback starts every rank from rank 0's weights,
MetricAverageCallback averages the logged metrics and LearningRateWarmupCallback ramps the
learning rate (scaled by the number of ranks) over the first epoch.  Prints
``FINAL_ACCURACY <x>`` on rank 0.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import hvdlite.tensorflow.keras as hvd  # noqa: E402


def make_data(n, seed):
    templates = np.random.RandomState(0).rand(10, 28, 28, 1).astype(np.float32)
    rng = np.random.RandomState(seed)
    y = rng.randint(0, 10, size=n)
    x = templates[y] + 0.6 * rng.randn(n, 28, 28, 1).astype(np.float32)
    return x, y


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=4096, help="training samples in all")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of one rank")
    args = p.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    x, y = make_data(args.samples, seed=1)
    x, y = x[hvd.rank() :: hvd.size()], y[hvd.rank() :: hvd.size()]  # this rank's shard
    x_test, y_test = make_data(1024, seed=2)

    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the callback syncs
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9))
    model.compile(
        optimizer=opt,
        metrics=["accuracy"],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=lr, warmup_epochs=1, verbose=1 if hvd.rank() == 0 else 0
        ),
    ]
    model.fit(
        x,
        y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )
    _, acc = model.evaluate(x_test, y_test, verbose=0)
    acc = float(np.asarray(hvd.allreduce(tf.constant(acc), op=hvd.Average)))
    if hvd.rank() == 0:
        print(f"FINAL_ACCURACY {acc:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
