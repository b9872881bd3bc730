#!/usr/bin/env python
"""Synthetic TensorFlow 2 benchmark with hvdlite, after Horovod's
``tensorflow2_synthetic_benchmark.py``: a small ResNet-style CNN on random images, a
``tf.function`` train step with ``DistributedGradientTape``; prints img/sec.

    hvdlite-run -np 2 python examples/tensorflow2_synthetic_benchmark.py
"""

import argparse
import os
import timeit

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402


def make_model(width, classes=1000):
    inputs = keras.Input((None, None, 3))
    h = keras.layers.Conv2D(width, 3, strides=2, padding="same", activation="relu")(inputs)
    for i in range(3):
        c = width * 2**i
        r = keras.layers.Conv2D(c, 1, padding="same")(h)
        h = keras.layers.Conv2D(c, 3, padding="same", activation="relu")(h)
        h = keras.layers.Conv2D(c, 3, padding="same")(h)
        h = keras.layers.ReLU()(keras.layers.Add()([h, r]))
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(classes)(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fp16-allreduce", action="store_true")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--num-warmup-batches", type=int, default=2)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=5)
    args = p.parse_args()

    hvd.init()
    model = make_model(args.width)
    opt = keras.optimizers.SGD(0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    target = tf.random.uniform([args.batch_size], maxval=1000, dtype=tf.int64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def benchmark_step(first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model(data, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    log(f"Batch size: {args.batch_size}, image size {args.image_size}, ranks: {hvd.size()}")
    benchmark_step(first_batch=True)
    timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)
    img_secs = []
    for i in range(args.num_iters):
        t = timeit.timeit(
            lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter
        )
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{i}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
