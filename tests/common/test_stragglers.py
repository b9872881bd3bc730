"""The straggler tally on synthetic ready ages (no processes)."""

import re

import numpy as np
import pytest

from hvdlite.common.diagnostics import stragglers
from hvdlite.common.diagnostics.stragglers import StragglerTracker, ready_age_us


def _run(ages_of_step, steps, step_s=0.05, window_s=1.0, ranks=(0, 1)):
    said = []
    tracker = StragglerTracker(list(ranks), window_s, lambda r, text: said.append((r, text)))
    t = 100.0
    for i in range(steps):
        t += step_s
        tracker.observe(np.array(ages_of_step(i), dtype=np.int32), t)
    return tracker, said


def test_a_rank_last_every_step_and_costly_is_named_once():
    # rank 1 became ready 45 ms after rank 0 in every 50 ms step
    tracker, said = _run(lambda i: [46000, 1000], steps=100)
    assert [r for r, _ in said] == [1], said  # rate-limited: not once per window
    assert re.search(r"rank 1 was the last to be ready in (\d+) of \1 completing", said[0][1])
    assert tracker.last_total == [0, 100]
    assert tracker.late_total_s[1] == pytest.approx(100 * 0.045)


def test_job_ranks_are_named_not_members():
    _, said = _run(lambda i: [1000, 46000, 46000], steps=30, ranks=(4, 7, 9))
    assert said and said[0][0] == 4 and "rank 4 was the last" in said[0][1]


def test_no_warning_when_the_last_rank_takes_turns():
    turns = ([1000, 46000, 46000], [46000, 1000, 46000], [46000, 46000, 1000])
    tracker, said = _run(lambda i: turns[i % 3], steps=100, ranks=(0, 1, 2))
    assert said == [] and sum(tracker.last_total) == 100


def test_no_warning_when_the_wait_is_cheap():
    # always last, but 3 ms of a 50 ms step: below a tenth of the time
    tracker, said = _run(lambda i: [4000, 1000], steps=100)
    assert said == [] and tracker.last_total == [0, 100]


def test_noise_below_the_spread_threshold_counts_nobody():
    tracker, said = _run(lambda i: [1500, 1000], steps=50)
    assert said == [] and tracker.last_total == [0, 0] and tracker.cycles_total == 50


def test_several_completions_in_one_wait_count_it_once():
    # completions 5 ms apart while the ages say 45 ms: after the first (45 ms, nothing
    # before it to bound it), each costs only the 5 ms since the previous one
    tracker, _ = _run(lambda i: [46000, 1000], steps=10, step_s=0.005)
    assert tracker.late_total_s[1] == pytest.approx(0.045 + 9 * 0.005)


def test_ready_age_entry():
    assert ready_age_us(None, 5.0) == stragglers.NOT_PENDING
    assert ready_age_us(4.5, 5.0) == 500000
    assert ready_age_us(-1e9, 5.0) == stragglers.NOT_PENDING - 1
