"""The framework-neutral part of gradient compression: the interface and the identity.

A compressor has static ``compress(tensor) -> (compressed, ctx)`` and
``decompress(tensor, ctx) -> tensor`` (Horovod's interface); the ops call them
duck-typed, so a user class with the same two static methods works too.  Each
framework adds its own float16 compressor and the ``Compression`` namespace.
"""


class Compressor:
    """Base of all compressors: override both static methods.

    ``compress`` must not modify its input.  ``ctx`` is whatever ``decompress`` needs to
    restore the original tensor (typically its dtype).
    """

    @staticmethod
    def compress(tensor):
        """Return ``(compressed_tensor, ctx)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Return the tensor restored from ``compress``'s output and ``ctx``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (identity; no copy)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor
