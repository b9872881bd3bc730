"""Fault injection for tests of a user's own elastic training script.

An elastic script is only tested once a rank really fails in the middle of training.
``hvdlite-run --fault-at rank=1,commit=3`` (its variable is in ``config.FAULT_AT``), or
``hvdlite.testing.fail_at(rank=1, commit=3)`` in the script) makes the process that is
rank 1 fail right after its third ``state.commit()``: the survivors' last commit is then
that same step, so a correct script resumes from it on the remaining ranks, losing and
repeating no step.  What the failure is:

* ``exit`` (the default): the process exits at once with ``exit_code`` (1), as a crash would,
  without ``shutdown()``;
* ``kill``: it sends itself SIGKILL;
* ``hang``: it sends itself SIGSTOP, a frozen process (its peers fail their next collective
  after ``--op-timeout-seconds``);
* ``raise``: ``commit()`` raises ``HvdliteInternalError`` on that rank only, as a failed
  collective would.

Commits are counted per process, from 1.  A plan fires once per process; ``round=K`` limits
it to rendezvous round K (round 0 is the job's first), so a replacement process that gets
the same rank later does not fail again.
"""

import dataclasses
import functools
import os
import signal
import sys
from typing import Optional

from hvdlite.common.exceptions import HvdliteConfigError, HvdliteInternalError

ACTIONS = ("exit", "kill", "hang", "raise")
#: the setting's name in messages (hvdlite.common.config adds its variable's name to refusals)
WHERE = "the fault plan (--fault-at)"
FORMAT = "rank=R,commit=N[,action=exit|kill|hang|raise][,exit_code=C][,round=K]"


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """Which process fails, when and how (see the module's docstring)."""

    rank: int
    commit: int
    action: str = "exit"
    exit_code: int = 1
    round: Optional[int] = None

    def __post_init__(self):
        if self.rank < 0 or self.commit < 1:
            raise HvdliteConfigError(
                f"{WHERE}: rank must be >= 0 and commit >= 1, got rank="
                f"{self.rank}, commit={self.commit}"
            )
        if self.action not in ACTIONS:
            raise HvdliteConfigError(
                f"{WHERE}: action {self.action!r} is not one of {', '.join(ACTIONS)}"
            )
        if not 0 <= self.exit_code <= 255:
            raise HvdliteConfigError(f"{WHERE}: exit_code must be 0..255, got {self.exit_code}")


def parse(spec: str) -> Optional[FaultPlan]:
    """The plan in ``spec`` (``""``: none).

    Raises:
        HvdliteConfigError: ``spec`` does not follow :data:`FORMAT` (the message says so).
    """
    if not spec.strip():
        return None
    fields = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if (
            not sep
            or key not in ("rank", "commit", "action", "exit_code", "round")
            or key in fields
        ):
            raise HvdliteConfigError(f"{WHERE}={spec!r}: expected {FORMAT}")
        fields[key] = value
    if "rank" not in fields or "commit" not in fields:
        raise HvdliteConfigError(f"{WHERE}={spec!r}: rank and commit are required ({FORMAT})")
    try:
        numbers = {k: int(v) for k, v in fields.items() if k != "action"}
    except ValueError:
        raise HvdliteConfigError(
            f"{WHERE}={spec!r}: rank, commit, exit_code and round are whole numbers ({FORMAT})"
        ) from None
    return FaultPlan(action=fields.get("action", "exit"), **numbers)


#: the configuration's spec is the same at every commit: parsed once
_parsed = functools.lru_cache(maxsize=4)(parse)


class _Injector:
    """This process's plan and commit count."""

    def __init__(self):
        self.plan: Optional[FaultPlan] = None  # set by arm(); else the config's
        self.commits = 0
        self.fired = False


_INJECTOR = _Injector()


def arm(plan: Optional[FaultPlan]) -> None:
    """Use ``plan`` in this process (None: the configuration's, if any); the commit count
    starts again."""
    _INJECTOR.plan, _INJECTOR.commits, _INJECTOR.fired = plan, 0, False


def on_commit(configured: str, rank: int, round_: int) -> None:
    """Count one commit of this process (``State.commit`` calls it after saving) and fail
    as planned when it is the chosen one.  ``configured``: the configuration's spec, used
    when no plan was armed in code.

    Raises:
        HvdliteInternalError: the plan's action is ``raise``.
    """
    plan = _INJECTOR.plan or _parsed(configured)
    if plan is None or _INJECTOR.fired:
        return
    _INJECTOR.commits += 1
    if (
        rank != plan.rank
        or _INJECTOR.commits != plan.commit
        or (plan.round is not None and round_ != plan.round)
    ):
        return
    _INJECTOR.fired = True
    sys.stdout.flush()
    sys.stderr.write(
        f"hvdlite: injected fault ({WHERE}): rank {rank} {plan.action} after "
        f"commit {plan.commit} (round {round_})\n"
    )
    sys.stderr.flush()
    if plan.action == "exit":
        os._exit(plan.exit_code)
    if plan.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if plan.action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
        return  # continued (SIGCONT): carry on
    raise HvdliteInternalError(f"rank {rank}: injected fault after commit {plan.commit}")
