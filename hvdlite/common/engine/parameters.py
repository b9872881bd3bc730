"""The tunables that may change while a job runs, applied by every rank in the same cycle.

Rank 0 alone proposes a change (by hand, or through the autotuner); the proposal
travels in the per-cycle control vector, so every rank switches at the same
cycle boundary and keeps executing the same fused groups as its peers.  Rank 0
writes its values and a version number there and every other rank writes
INT32_MAX, so the MIN is rank 0's proposal.  The runtime's memoised fusion
plans are keyed by that version, so a change never reuses a stale plan.
"""

import dataclasses
from typing import List

from hvdlite.common.exceptions import HvdliteConfigError

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Parameters:
    """One consistent set of live tunables (see :class:`hvdlite.common.config.Config`)."""

    fusion_threshold_bytes: int
    fusion_chunk_bytes: int
    inplace_threshold_bytes: int
    cycle_time_ms: float
    cache_enabled: bool

    #: how many int32 slots :meth:`encode` fills
    WIDTH = 5

    @classmethod
    def from_config(cls, config) -> "Parameters":
        """The rank's starting values, taken as they are: ``Config`` checked their ranges
        (the tunables' table bounds each to what the control vector can carry)."""
        return cls(
            config.fusion_threshold_bytes,
            config.fusion_chunk_bytes,
            config.inplace_threshold_bytes,
            config.cycle_time_ms,
            config.cache_capacity > 0,
        )

    def replace(self, **changes) -> "Parameters":
        """A proposal (by hand or from the autotuner): checked here, the only values that
        did not come through ``Config``.

        Raises:
            HvdliteConfigError: an unknown name, or a value the control vector cannot carry.
        """
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise HvdliteConfigError(
                f"unknown live parameters {sorted(unknown)}; known: "
                f"{[f.name for f in dataclasses.fields(self)]}"
            )
        new = dataclasses.replace(self, **changes)
        for name in ("fusion_threshold_bytes", "inplace_threshold_bytes"):
            if not 0 <= getattr(new, name) <= _INT32_MAX:
                raise HvdliteConfigError(
                    f"parameter {name}={getattr(new, name)} must be 0..{_INT32_MAX}"
                )
        if not 1 <= new.fusion_chunk_bytes <= _INT32_MAX:
            raise HvdliteConfigError(
                f"parameter fusion_chunk_bytes={new.fusion_chunk_bytes} must be 1..{_INT32_MAX}"
            )
        if not 0 <= new.cycle_time_ms * 1000 <= _INT32_MAX:
            raise HvdliteConfigError(
                f"parameter cycle_time_ms={new.cycle_time_ms} must be "
                f">= 0 and below {_INT32_MAX // 1000} ms"
            )
        return new

    def encode(self) -> List[int]:
        """int32 values for the control vector (the cycle time in microseconds)."""
        return [
            self.fusion_threshold_bytes,
            self.fusion_chunk_bytes,
            self.inplace_threshold_bytes,
            int(round(self.cycle_time_ms * 1000)),
            int(self.cache_enabled),
        ]

    @classmethod
    def decode(cls, values) -> "Parameters":
        fusion, chunk, inplace, cycle_us, cache = (int(v) for v in values)
        return cls(fusion, chunk, inplace, cycle_us / 1000.0, bool(cache))
