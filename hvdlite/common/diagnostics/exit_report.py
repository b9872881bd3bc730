"""A rank tells the launcher why it is exiting, so the job's summary names the cause.

When a rank raises, its peers fail a moment later with ``HvdliteInternalError``
("rank 1 shut down"), and whichever exit the launcher sees first is often one of
theirs.  So at an uncaught exception each rank of a job with a launcher's store
sends one *exit report* over the store's authenticated channel: its slot, its
exception's last line, and whether that exception was only a peer's failure seen
from here (``HvdliteInternalError``).  The launcher names the first report that was
not (``hvdlite.runner.agent.blame``).  Best effort and bounded: a rank that cannot
reach the store within a second exits as it would have.
"""

import logging
import sys
import traceback
from typing import Optional, Tuple

from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.net.service import Client

log = logging.getLogger(__name__)

#: bound on sending the report (the rank is on its way out)
REPORT_TIMEOUT_S = 1.0


class _Target:
    """Where this process reports: the store and this process's slot."""

    addr: Optional[Tuple[str, int]] = None
    key: Optional[bytes] = None
    slot: Tuple[str, int] = ("", 0)
    #: this process's rank once the backend numbered it (a launcher without a rendezvous,
    #: ``--mpi``, cannot tell it from the slot)
    rank: Optional[int] = None
    previous_hook = None


_TARGET = _Target()


def install(
    addr: Optional[str], port: Optional[int], key: Optional[bytes], hostname: str, local_slot: int
) -> None:
    """Report this process's uncaught exception to the store at ``addr:port`` (the
    rendezvous store, or under ``--mpi`` the launcher's report store; a no-op without
    one).  Idempotent: a re-init updates the target."""
    if addr is None or port is None or key is None:
        return
    _TARGET.addr, _TARGET.key, _TARGET.slot = (addr, int(port)), key, (hostname, local_slot)
    _TARGET.rank = None
    if _TARGET.previous_hook is None:
        _TARGET.previous_hook = sys.excepthook
        sys.excepthook = _hook


def slot() -> Optional[Tuple[str, int]]:
    """The (host, local slot) this process joins rounds with (None: no launcher's store)."""
    return None if _TARGET.addr is None else _TARGET.slot


def name_rank(rank: int) -> None:
    """The rank the backend gave this process, sent with its report from now on."""
    _TARGET.rank = int(rank)


def _hook(exc_type, exc, tb) -> None:
    try:
        send(exc)
    finally:
        (_TARGET.previous_hook or sys.__excepthook__)(exc_type, exc, tb)


def send(exc: BaseException) -> bool:
    """Send the report for ``exc``; False when it could not be delivered."""
    if _TARGET.addr is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return False
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    client = Client(_TARGET.addr, _TARGET.key, REPORT_TIMEOUT_S, name="rendezvous store")
    try:
        client.request(
            {
                "op": "exit_report",
                "hostname": _TARGET.slot[0],
                "local_rank": _TARGET.slot[1],
                "rank": _TARGET.rank,
                "peer": isinstance(exc, HvdliteInternalError),
                "error": line,
            },
            timeout_s=REPORT_TIMEOUT_S,
        )
        return True
    except Exception as err:  # noqa: BLE001 -- never mask the exception being reported
        log.debug("exit report not delivered: %s", err)
        return False
    finally:
        client.close()
