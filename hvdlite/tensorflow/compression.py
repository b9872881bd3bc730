"""Gradient compression around a collective, as ``horovod.tensorflow.Compression``.

A compressor has static ``compress(tensor) -> (compressed, ctx)`` and
``decompress(tensor, ctx) -> tensor``; the ops call them duck-typed, so a user class
with the same two static methods works too.
"""

import tensorflow as tf

from hvdlite.common.compression import Compressor, NoneCompressor
from hvdlite.tensorflow.powersgd import PowerSGD

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and come back in their own dtype."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tf.cast(tensor, ctx) if ctx is not None and tensor.dtype != ctx else tensor


class Compression:
    """The compressors by Horovod's names: ``Compression.none``, ``Compression.fp16``; and
    ``Compression.powersgd(...)``, for the Keras ``DistributedOptimizer`` only."""

    none = NoneCompressor
    fp16 = FP16Compressor
    powersgd = PowerSGD
