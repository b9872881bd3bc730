"""Helpers for testing your own training scripts under hvdlite.

:func:`fail_at` makes one rank fail at a chosen ``state.commit()`` of an elastic job, so a
test can check that the script recovers: that the survivors resume from the last commit,
lose and repeat no step, and end with the state a fault-free run reaches.  The same plan can
be given without changing the script: ``hvdlite-run --fault-at rank=1,commit=3 ...`` (or
``HVDLITE_FAULT_AT``).  See :mod:`hvdlite.common.fault_injection` for what each action does.
"""

from typing import Optional

from hvdlite.common import fault_injection

__all__ = ["fail_at", "clear_faults", "ACTIONS"]

ACTIONS = fault_injection.ACTIONS


def fail_at(
    rank: int, commit: int, action: str = "exit", exit_code: int = 1, round: Optional[int] = None
) -> None:  # noqa: A002 -- the setting's own name
    """Make the process that is ``rank`` fail right after its ``commit``-th
    ``state.commit()`` (counted from 1 in this process, from this call on).

    Args:
        rank: the rank (at the time of the commit) that fails.
        commit: which of this process's commits.
        action: ``"exit"`` (exit at once with ``exit_code``, as a crash), ``"kill"``
            (SIGKILL), ``"hang"`` (SIGSTOP: a frozen process) or ``"raise"``
            (``HvdliteInternalError`` from ``commit()`` on that rank only).
        exit_code: the exit status of ``"exit"``.
        round: only in this rendezvous round (0: the job's first), so a replacement that
            gets the same rank later does not fail again; None: any round.

    Raises:
        HvdliteConfigError: an argument is out of range or the action unknown.
    """
    fault_injection.arm(fault_injection.FaultPlan(rank, commit, action, exit_code, round))


def clear_faults() -> None:
    """Forget a plan made with :func:`fail_at` (the ``--fault-at`` setting applies again)."""
    fault_injection.arm(None)
