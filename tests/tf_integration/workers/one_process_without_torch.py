"""A plain one-rank TensorFlow process (no launcher: the local backend) without torch: every
op on numpy buffers, objects too, and torch never imported."""

import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, REPO)
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"

from tests.tf_integration.no_torch import block_torch, torch_modules  # noqa: E402

block_torch()

import tensorflow as tf  # noqa: E402

import hvdlite.tensorflow as hvd  # noqa: E402

hvd.init()
assert hvd.size() == 1
for dt in (tf.float32, tf.bfloat16, tf.int32, tf.bool):
    x = tf.cast(tf.constant([[1, 0], [2, 3]]), dt)
    op = hvd.Max if dt == tf.bool else hvd.Sum
    assert hvd.allreduce(x, op=op).numpy().tolist() == x.numpy().tolist()
    assert hvd.allgather(x).numpy().tolist() == x.numpy().tolist()
    assert hvd.broadcast(x, 0).numpy().tolist() == x.numpy().tolist()
    assert hvd.alltoall(x).numpy().tolist() == x.numpy().tolist()
    if dt != tf.bool:
        assert hvd.reducescatter(x, op=hvd.Sum).numpy().tolist() == x.numpy().tolist()
assert hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Adasum).numpy().tolist() == [1.0, 2.0]
assert hvd.broadcast_object({"a": 1}) == {"a": 1} and hvd.allgather_object(3) == [3]
assert not torch_modules(), torch_modules()[:3]
hvd.shutdown()
print("ok")
