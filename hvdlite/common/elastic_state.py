"""Elastic training, the framework-neutral part: State, ObjectState and the reset loop.

A training function wrapped by :func:`run_fn` survives two events:

* a peer died (or hung) in a collective: every survivor gets an
  :class:`HvdliteInternalError`, rolls its state back to the last ``commit()``,
  and re-initialises into the next rendezvous round, which the elastic driver
  opens without the dead worker;
* the job's hosts changed (the driver opened a newer round): ``commit()`` raises
  :class:`HostsUpdatedInterrupt` on every rank at the same commit; the current
  state is kept and every rank re-initialises into the new round.

After re-initialising, ``state.sync()`` makes every rank (new ones included)
equal to rank 0, which the driver always gives to a surviving worker, then the
reset callbacks run (e.g. to rescale the learning rate by the new size) and the
function is called again; it resumes from the values kept in the state.
A process whose host was removed from the job leaves with exit code 0.
"""

import copy
import functools
import logging
from typing import Any, Callable, Dict, List

from hvdlite.common import arrays, basics, fault_injection, ops
from hvdlite.common.exceptions import (
    HostsUpdatedInterrupt,
    HvdliteInternalError,
    HvdliteRemovedError,
)

log = logging.getLogger(__name__)

#: how often one reset may fail (a peer dying while the next round forms) before giving up
_RESET_ATTEMPTS = 5


class State:
    """State that survives resets; subclasses say how to save, restore and sync it.

    Args:
        bcast_object: ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank (a
            framework's ``broadcast_object``); it keeps this module free of any
            framework.
    """

    def __init__(self, bcast_object: Callable[[Any], Any]):
        self._bcast_object = bcast_object
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after every reset, once the state is synced.

        Args:
            callbacks: functions without arguments, e.g. to rescale the learning rate to
                the new ``size()``.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (``run`` calls it after each reset)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (the point a failure rolls back to), then check for new hosts.

        Raises:
            HostsUpdatedInterrupt: the job's membership changed; ``run`` resets.
        """
        self.save()
        fault_injection.on_commit(
            basics.config().fault_at, basics.rank(), basics.rendezvous_round()
        )
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank if the driver opened a newer round.

        Rank 0 asks the rendezvous and a MAX-allreduce gives every rank its answer, so all
        ranks raise at the same call.  Outside elastic mode membership never changes and
        this costs nothing.
        """
        if not basics.config().elastic:
            return
        mine = basics.rendezvous_round()
        asked = basics.newest_rendezvous_round() if basics.rank() == 0 else mine
        buf = arrays.kind().tensor([asked], "int64")
        ops.synchronize(ops.allreduce_one(buf, buf, "elastic.check_host_updates", ops.Max))
        newest = int(buf.item())
        if newest > mine:
            log.info(
                "rank %d: rendezvous round %d is open (this rank is in round %d): resetting",
                basics.rank(),
                newest,
                mine,
            )
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        """Keep a copy of the state: what a failure rolls back to."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put back the copy of the last :meth:`save`."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError


class ObjectState(State):
    """Plain values (numbers, lists, dicts) kept as attributes: ``state.epoch``.

    ``save`` keeps a deep copy; ``restore`` puts it back; ``sync`` gives every rank
    rank 0's saved values.

    Args:
        bcast_object: as for :class:`State`.
        kwargs: the values by name, with their initial values.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], **kwargs):
        super().__init__(bcast_object)
        self._saved_state: Dict[str, Any] = copy.deepcopy(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        """Keep a deep copy of every value."""
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        """Set every value back to the last :meth:`save`'s copy."""
        self._set_attrs()

    def sync(self) -> None:
        """Give every rank rank 0's saved values."""
        if self._saved_state:
            self._saved_state = copy.deepcopy(self._bcast_object(self._saved_state))
            self._set_attrs()


def _reset() -> None:
    """Leave the current round and join the next one."""
    basics.shutdown()
    basics.start_runtime()


def _reset_into_next_round(reset: Callable[[], None]) -> None:
    """``reset()``, again if a peer fails while the next round forms; exit cleanly if this
    process has no place in the job any more."""
    for attempt in range(1, _RESET_ATTEMPTS + 1):
        try:
            reset()
            return
        except HvdliteRemovedError as exc:
            log.warning("%s", exc)
            raise SystemExit(0) from None
        except HvdliteInternalError as exc:
            if attempt == _RESET_ATTEMPTS:
                raise
            log.warning(
                "joining the next rendezvous round failed (%s); trying the round "
                "after it (attempt %d of %d)",
                exc,
                attempt + 1,
                _RESET_ATTEMPTS,
            )


def run_fn(func: Callable, reset: Callable[[], None] = _reset) -> Callable:
    """Wrap ``func(state, ...)`` in the elastic reset loop (see the module docstring).

    Raises:
        HvdliteInternalError: outside elastic mode (a static job cannot replace a peer),
            or when re-initialising fails in a way no later round can mend (a timeout).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HvdliteInternalError as exc:
                if not basics.config().elastic:
                    raise
                log.warning("%s; restoring the last commit and resetting", exc)
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            _reset_into_next_round(reset)
            state.on_reset()

    return wrapper
