"""Whom a static job's failure summary names (``hvdlite.runner.agent.blame``), on fakes."""

from hvdlite.runner.agent import blame
from hvdlite.runner.store import exit_reports

A0, A1, B0 = ("a", 0), ("a", 1), ("b", 0)
RANKS = {A0: (0, "a"), A1: (1, "a"), B0: (2, "b")}


def summary(exits, reports=None, stopped=()):
    return blame.FailureSummary(
        ranks=RANKS,
        exits=exits,
        reports=lambda: dict(reports or {}),
        stopped=lambda: list(stopped),
        op_timeout_s=3.0,
    )


def test_first_own_failure_is_named_over_the_rank_that_exited_first():
    reports = {
        A0: {"peer": True, "error": "HvdliteInternalError: rank 1 shut down", "at": 2.0},
        B0: {"peer": False, "error": "KeyError: 'x'", "at": 1.5},
        A1: {"peer": False, "error": "ValueError: bad", "at": 1.0},
    }
    line = summary([(A0, 1)], reports).line((A0, 1))
    assert line == (
        "hvdlite-run: rank 1 on host a failed first: ValueError: bad; rank 0 on "
        "host a then failed (exited with code 1); the other ranks were "
        "terminated.\n"
    )


def test_the_failing_rank_itself_with_its_exception():
    reports = {B0: {"peer": False, "error": "RuntimeError: oom", "at": 1.0}}
    assert summary([(B0, 1)], reports).line((B0, 1)) == (
        "hvdlite-run: rank 2 on host b exited with code 1: RuntimeError: oom; the other "
        "ranks were terminated.\n"
    )


def test_without_reports_a_rank_that_left_early_or_is_stopped_is_named(monkeypatch):
    monkeypatch.setattr(exit_reports, "REPORT_GRACE_S", 0.0)
    early = summary([(A1, 0), (A0, 1)]).line((A0, 1))
    assert early.startswith(
        "hvdlite-run: rank 1 on host a exited with code 0 before its "
        "peers finished; rank 0 on host a then failed"
    ), early
    stopped = summary([(A0, 1)], stopped=[B0]).line((A0, 1))
    assert stopped.startswith("hvdlite-run: rank 2 on host b stopped answering for 3s"), stopped
    plain = summary([(A0, -9)]).line((A0, -9))
    assert plain == (
        "hvdlite-run: rank 0 on host a was killed by signal SIGKILL; the other "
        "ranks were terminated.\n"
    )
