"""The fault-injection plan (``--fault-at`` / ``hvdlite.testing.fail_at``): its parsing, and
which commit of which rank fires.  A real elastic job recovering from it is in
tests/elastic/test_elastic_launch.py."""

import pytest

from hvdlite.common import fault_injection
from hvdlite.common.config import FAULT_AT, Config
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteInternalError
from hvdlite.testing import clear_faults, fail_at


def test_a_plan_parses_with_its_defaults():
    assert fault_injection.parse("") is None
    plan = fault_injection.parse("rank=1, commit=3")
    assert plan == fault_injection.FaultPlan(1, 3, "exit", 1, None)
    assert fault_injection.parse("rank=0,commit=2,action=hang,round=0").round == 0


@pytest.mark.parametrize(
    "spec, words",
    [
        ("rank=1", "rank and commit are required"),
        ("rank=1,commit=x", "whole numbers"),
        ("rank=1,commit=2,action=explode", "action 'explode' is not one of exit, kill"),
        ("rank=1,commit=0", "commit >= 1"),
        ("rank=1,commit=2,when=now", "expected rank=R,commit=N"),
        ("rank=1,rank=2,commit=1", "expected rank=R,commit=N"),
        ("rank=1,commit=2,exit_code=300", "exit_code must be 0..255"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_setting(spec, words):
    with pytest.raises(HvdliteConfigError, match="--fault-at") as err:
        fault_injection.parse(spec)
    assert words in str(err.value)
    with pytest.raises(HvdliteConfigError) as err:  # at init, not at a commit
        Config.from_env({FAULT_AT: spec}, warn=False)
    assert str(err.value).startswith(f"{FAULT_AT}: ") and words in str(err.value)


def test_raise_fires_once_on_the_chosen_rank_and_commit():
    try:
        fail_at(rank=1, commit=2, action="raise", round=0)
        fault_injection.on_commit("", rank=0, round_=0)  # another rank: counts only
        with pytest.raises(HvdliteInternalError, match="injected fault after commit 2"):
            fault_injection.on_commit("", rank=1, round_=0)
        fault_injection.on_commit("", rank=1, round_=0)  # once per process
        fail_at(rank=1, commit=1, action="raise", round=1)
        fault_injection.on_commit("", rank=1, round_=0)  # another round: nothing
        fail_at(rank=1, commit=1, action="raise")
        with pytest.raises(HvdliteInternalError):
            fault_injection.on_commit("", rank=1, round_=5)
        clear_faults()
        with pytest.raises(HvdliteInternalError):  # the setting applies again
            fault_injection.on_commit("rank=1,commit=1,action=raise", rank=1, round_=0)
    finally:
        clear_faults()
