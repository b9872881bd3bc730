"""Gradient compression around a collective, as ``horovod.tensorflow.Compression``.

A compressor has static ``compress(tensor) -> (compressed, ctx)`` and
``decompress(tensor, ctx) -> tensor``; the ops call them duck-typed, so a user class
with the same two static methods works too.
"""

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Base of all compressors: override both static methods (``compress`` must not modify
    its input; ``ctx`` is what ``decompress`` needs, typically the dtype)."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


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
    """The compressors by Horovod's names: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
