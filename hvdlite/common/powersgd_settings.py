"""PowerSGD's settings, shared by the torch and TensorFlow implementations.

Both frameworks take the same arguments, refuse the same bad values and compress the same
matrices; only the algorithm's tensors differ (``hvdlite.torch.powersgd``,
``hvdlite.tensorflow.powersgd``).
"""

from typing import Optional, Tuple


class PowerSGDSettings:
    """Rank, warm-up, which matrices are compressed, and the seed of the first ``Q``.

    Args:
        rank: columns of the low-rank factors (1 to 4 is typical; more is closer to the
            uncompressed gradient and sends more).
        start_iter: optimizer steps reduced uncompressed before compression starts.
        min_compression_rate: compress a ``n x m`` matrix only when
            ``n m / ((n + m) rank)`` is at least this (small matrices go uncompressed).
        seed: seed of the first ``Q`` (with the parameter's identity, so every rank agrees).

    Raises:
        ValueError: ``rank`` < 1, ``start_iter`` < 0 or ``min_compression_rate`` <= 0.
    """

    kind = "powersgd"

    def __init__(
        self, rank: int = 4, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0
    ):
        if int(rank) < 1:
            raise ValueError(f"hvd.Compression.powersgd: rank={rank} must be >= 1")
        if int(start_iter) < 0:
            raise ValueError(f"hvd.Compression.powersgd: start_iter={start_iter} must be >= 0")
        if min_compression_rate <= 0:
            raise ValueError(
                f"hvd.Compression.powersgd: min_compression_rate={min_compression_rate} must be > 0"
            )
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)

    def __repr__(self):
        return (
            f"hvd.Compression.powersgd(rank={self.rank}, start_iter={self.start_iter}, "
            f"min_compression_rate={self.min_compression_rate}, seed={self.seed})"
        )

    def factor_shape(self, n: int, m: int) -> Optional[Tuple[int, int, int]]:
        """``(n, m, rank)`` when a ``n x m`` matrix is worth compressing, else ``None``."""
        r = min(self.rank, n, m)
        if n * m < self.min_compression_rate * (n + m) * r:
            return None
        return n, m, r
