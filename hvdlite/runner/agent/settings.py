"""What the agent's loop needs to know about a job's size and failures: :class:`JobSettings`.

A static job is :meth:`JobSettings.static_job` (``-np`` slots, no resets: the first
failure ends it); an elastic job's flags are checked once at launch by :func:`validate`.
Every job's sizes are at most ``--max-workers`` (:func:`check_sizes`): the CLI, Ray and
Spark check their arguments with it before anything starts, and ``run_job`` checks every
spec with it again (a plain ``srun`` step's, or one a caller built by hand).  The messages
name the caller's own arguments (:class:`SizeNames`).
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

    np: int  # -np: the first round waits for this many
    min_np: int  # --min-np
    max_np: Optional[int] = None  # --max-np (None: no cap)
    reset_limit: Optional[int] = None  # --reset-limit (None: unlimited)
    cooldown_range: Optional[Tuple[float, float]] = None  # --blacklist-cooldown-range
    #: a static job: exactly ``np`` ranks, no rounds after the first, and a failed rank
    #: ends the job (its summary names the rank that failed first)
    static: bool = False

    @classmethod
    def static_job(cls, np: int) -> "JobSettings":
        """A fixed job of ``np`` ranks."""
        return cls(np=np, min_np=np, max_np=np, reset_limit=0, static=True)


@dataclasses.dataclass(frozen=True)
class SizeNames:
    """What the caller calls the job's sizes in its messages: the launcher's flags
    (``-np 4``), or a platform's arguments (``num_workers=4``)."""

    np: str = "-np"
    min_np: str = "--min-np"
    max_np: str = "--max-np"
    reset_limit: str = "--reset-limit"
    #: between a name and its value
    joiner: str = " "

    def said(self, field: str, value) -> str:
        """``-np 4`` / ``num_workers=4``: the size ``field`` as the caller gave it."""
        return f"{getattr(self, field)}{self.joiner}{value}"


#: hvdlite-run's flags (and hvdlite.run's, which takes the same)
FLAGS = SizeNames()


def check_sizes(
    np: int,
    min_np: Optional[int] = None,
    max_np: Optional[int] = None,
    *,
    ceiling: int,
    names: SizeNames = FLAGS,
) -> None:
    """At least one process, and no size above ``ceiling`` (``--max-workers`` /
    ``HVDLITE_MAX_WORKERS``), before a host list is built or a slot placed: without -H the
    host list is ``localhost:NP``, and placing 10**20 slots fills the memory first.

    Raises:
        HvdliteConfigError: names the argument, its value and the ceiling (and how to
            raise it).
    """
    if np < 1:
        raise HvdliteConfigError(
            f"{names.said('np', np)}: the number of processes must be at least 1"
        )
    for field, value in (("np", np), ("min_np", min_np), ("max_np", max_np)):
        if value is not None and value > ceiling:
            said = names.said(field, value)
            raise HvdliteConfigError(
                f"{said}: more than the {ceiling} worker processes one job may run "
                f"(--max-workers / {cfg.MAX_WORKERS}); lower {getattr(names, field)}, or "
                f"raise --max-workers if the hosts can hold {value} processes"
            )


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


def validate(
    *,
    np: int,
    min_np: Optional[int],
    max_np: Optional[int],
    reset_limit: Optional[int],
    cooldown_range: Optional[Sequence[float]],
    slots_per_host: Optional[int],
    discovery_script: Optional[str],
    fixed_hosts: bool,
    mpi: bool,
    names: SizeNames = FLAGS,
) -> JobSettings:
    """Check the elastic flags of one launch (``np`` >= 1 is already checked).

    ``fixed_hosts``: -H or --hostfile was given.  ``None`` means the flag was not given.
    ``names``: what the caller calls the sizes (a platform's arguments).

    Raises:
        HvdliteConfigError: a bad value or combination; the message names the flag.
    """
    if mpi:
        raise HvdliteConfigError(
            "--min-np/--max-np/--host-discovery-script cannot be used with --mpi: an MPI job "
            "cannot change its world; use Gloo (drop --mpi)"
        )
    if discovery_script and fixed_hosts:
        raise HvdliteConfigError(
            "--host-discovery-script replaces -H/--hostfile; give one or the other"
        )
    min_np = np if min_np is None else min_np
    said = names.said
    if min_np < 1:
        raise HvdliteConfigError(f"{said('min_np', min_np)}: must be at least 1")
    if max_np is not None and max_np < min_np:
        raise HvdliteConfigError(f"{said('min_np', min_np)} is more than {said('max_np', max_np)}")
    if not min_np <= np <= (np if max_np is None else max_np):
        raise HvdliteConfigError(
            f"{said('np', np)} must be between {said('min_np', min_np)} and "
            f"{said('max_np', 'unlimited' if max_np is None else max_np)}"
        )
    if slots_per_host is not None and slots_per_host < 1:
        raise HvdliteConfigError(f"--slots-per-host {slots_per_host}: must be at least 1")
    if reset_limit is not None and reset_limit < 0:
        raise HvdliteConfigError(f"{said('reset_limit', reset_limit)}: must be >= 0")
    cooldown = _cooldown(cooldown_range)
    if discovery_script is not None:
        _check_discovery_script(discovery_script)
    return JobSettings(
        np=np, min_np=min_np, max_np=max_np, reset_limit=reset_limit, cooldown_range=cooldown
    )


def _cooldown(cooldown_range: Optional[Sequence[float]]) -> Optional[Tuple[float, float]]:
    """--blacklist-cooldown-range as (MIN, MAX) seconds, or None when not given.

    Raises:
        HvdliteConfigError: not 0 <= MIN <= MAX.
    """
    if cooldown_range is None:
        return None
    low, high = (float(x) for x in cooldown_range)
    if not 0 <= low <= high:
        raise HvdliteConfigError(
            f"--blacklist-cooldown-range {low:g} {high:g}: expected 0 <= MIN <= MAX seconds"
        )
    return low, high


def _check_discovery_script(path: str) -> None:
    """Raises: HvdliteConfigError: --host-discovery-script is not an executable file."""
    if not os.path.isfile(path):
        raise HvdliteConfigError(f"--host-discovery-script {path}: no such file")
    if not os.access(path, os.X_OK):
        raise HvdliteConfigError(f"--host-discovery-script {path}: not executable (chmod +x it)")


def platform_ceiling() -> int:
    """--max-workers for a platform's job (Ray, Spark), which has no flags: as this
    process's environment sets it (``HVDLITE_MAX_WORKERS``)."""
    return cfg.Config.tunables_of(os.environ).max_workers
