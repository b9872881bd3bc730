"""Live parameters: a rank's start values come from its checked Config as they are; only
proposals, which did not come through Config, are checked."""

import pytest

from hvdlite.common.config import Config
from hvdlite.common.engine.parameters import Parameters
from hvdlite.common.exceptions import HvdliteConfigError


def test_a_config_gives_its_values_unchanged():
    c = Config(
        fusion_threshold_bytes=2**31 - 1,
        fusion_chunk_bytes=4096,
        inplace_threshold_bytes=0,
        cycle_time_ms=2.5,
        cache_capacity=0,
    )
    p = Parameters.from_config(c)
    assert (
        p.fusion_threshold_bytes,
        p.fusion_chunk_bytes,
        p.inplace_threshold_bytes,
        p.cycle_time_ms,
        p.cache_enabled,
    ) == (2**31 - 1, 4096, 0, 2.5, False)
    assert Parameters.decode(p.encode()) == p


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"fusion_threshold_bytes": 2**31}, "fusion_threshold_bytes=2147483648 must be 0.."),
        ({"inplace_threshold_bytes": -1}, "inplace_threshold_bytes=-1 must be 0.."),
        ({"fusion_chunk_bytes": 0}, "fusion_chunk_bytes=0 must be 1.."),
        ({"cycle_time_ms": 3e6}, "cycle_time_ms=3000000.0 must be >= 0"),
        ({"cycle": 1}, r"unknown live parameters \['cycle'\]"),
    ],
)
def test_a_proposal_the_control_vector_cannot_carry_is_refused(changes, words):
    p = Parameters.from_config(Config())
    with pytest.raises(HvdliteConfigError, match=words):
        p.replace(**changes)
    assert p.replace(cycle_time_ms=4.0).cycle_time_ms == 4.0
