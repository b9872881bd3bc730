"""What the agent's loop needs to know about a job's size and failures: :class:`JobSettings`.

A static job is :meth:`JobSettings.static_job` (``-np`` slots, no resets: the first
failure ends it); an elastic job's flags are checked once at launch by :func:`validate`.
The elastic timeout is a tunable: it lives in the job's ``Config`` (a platform's argument
is checked by :func:`check_elastic_timeout`), not here.
"""

import dataclasses
import os
from typing import Optional, Sequence, Tuple

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What the agent needs from the flags: how many ranks, and what a failure does."""

    np: int                                     # -np: the first round waits for this many
    min_np: int                                 # --min-np
    max_np: Optional[int] = None                # --max-np (None: no cap)
    reset_limit: Optional[int] = None           # --reset-limit (None: unlimited)
    cooldown_range: Optional[Tuple[float, float]] = None   # --blacklist-cooldown-range
    #: a static job: exactly ``np`` ranks, no rounds after the first, and a failed rank
    #: ends the job (its summary names the rank that failed first)
    static: bool = False

    @classmethod
    def static_job(cls, np: int) -> "JobSettings":
        """A fixed job of ``np`` ranks."""
        return cls(np=np, min_np=np, max_np=np, reset_limit=0, static=True)


def check_elastic_timeout(seconds: Optional[float], name: str) -> Optional[float]:
    """A platform's elastic-timeout argument ``name``, checked by the tunable's own rule
    before anything starts (the job stores it in its tunables: ``JobSpec.with_elastic_timeout``).

    Raises:
        HvdliteConfigError: names the argument, its value and the allowed range.
    """
    if seconds is None:
        return None
    try:
        cfg.Config().replace(elastic_timeout_s=float(seconds))
    except cfg.HvdliteSettingError as exc:
        raise HvdliteConfigError(f"{name}={seconds!r}: {exc.reason}") from None
    return float(seconds)


def validate(*, np: int, min_np: Optional[int], max_np: Optional[int],
             reset_limit: Optional[int],
             cooldown_range: Optional[Sequence[float]], slots_per_host: Optional[int],
             discovery_script: Optional[str], fixed_hosts: bool, mpi: bool) -> JobSettings:
    """Check the elastic flags of one launch (``np`` >= 1 is already checked).

    ``fixed_hosts``: -H or --hostfile was given.  ``None`` means the flag was not given.

    Raises:
        HvdliteConfigError: a bad value or combination; the message names the flag.
    """
    if mpi:
        raise HvdliteConfigError(
            "--min-np/--max-np/--host-discovery-script cannot be used with --mpi: an MPI job "
            "cannot change its world; use Gloo (drop --mpi)")
    if discovery_script and fixed_hosts:
        raise HvdliteConfigError(
            "--host-discovery-script replaces -H/--hostfile; give one or the other")
    min_np = np if min_np is None else min_np
    if min_np < 1:
        raise HvdliteConfigError(f"--min-np {min_np}: must be at least 1")
    if max_np is not None and max_np < min_np:
        raise HvdliteConfigError(f"--min-np {min_np} is more than --max-np {max_np}")
    if not min_np <= np <= (np if max_np is None else max_np):
        raise HvdliteConfigError(
            f"-np {np} must be between --min-np {min_np} and --max-np "
            f"{'unlimited' if max_np is None else max_np}")
    if slots_per_host is not None and slots_per_host < 1:
        raise HvdliteConfigError(f"--slots-per-host {slots_per_host}: must be at least 1")
    if reset_limit is not None and reset_limit < 0:
        raise HvdliteConfigError(f"--reset-limit {reset_limit}: must be >= 0")
    cooldown = None
    if cooldown_range is not None:
        low, high = (float(x) for x in cooldown_range)
        if not 0 <= low <= high:
            raise HvdliteConfigError(
                f"--blacklist-cooldown-range {low:g} {high:g}: expected 0 <= MIN <= MAX seconds")
        cooldown = (low, high)
    if discovery_script is not None:
        if not os.path.isfile(discovery_script):
            raise HvdliteConfigError(f"--host-discovery-script {discovery_script}: no such file")
        if not os.access(discovery_script, os.X_OK):
            raise HvdliteConfigError(
                f"--host-discovery-script {discovery_script}: not executable (chmod +x it)")
    return JobSettings(np=np, min_np=min_np, max_np=max_np, reset_limit=reset_limit,
                       cooldown_range=cooldown)
