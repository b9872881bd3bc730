"""Process sets: collectives among a subset of the job's ranks.

A registered set other than the global one has a runtime of its own on each of
its members: its own background thread, queue, negotiation, response cache and
fusion buffers, over its own transport (a ProcessGroupGloo under the round's
store prefix ``set<id>/``, or an MPI communicator made with
``MPI_Comm_create_group`` from a spare duplicate of the job's communicator, so
the background thread's communicator is never used from a user thread).  So a
set negotiates only among its members and runs concurrently with every other
set.  Ranks that are not members keep only the set's description; an op on
the set raises ``ValueError`` there.  A set's runtime and backend name job
ranks in their messages (``Runtime.ranks``).

The registry here is the state, identical on every rank; adding and removing
sets are collectives over every rank of the job and live in
:mod:`hvdlite.common.ops`, which first agrees on the change with two
allgathers, so ids match everywhere and a rank that asks for something else
makes every rank raise the same ``ValueError``.  Ids are never reused within
one ``init()``, so a re-added set never meets the store keys of a removed one.
Every set's runtime stops at ``shutdown()`` (a reset hook), before the global
one.
"""

import logging
import threading
from typing import Dict, List, Optional, Sequence

from hvdlite.common import basics
from hvdlite.common.backend.local import LocalBackend
from hvdlite.common.exceptions import HvdliteInternalError
from hvdlite.common.engine.runtime import Runtime

log = logging.getLogger(__name__)


class ProcessSet:
    """A set of ranks that runs collectives among themselves (``process_set=``).

    Built from a list of ranks of the job (or, under MPI, from an mpi4py communicator
    whose processes are the members; a non-member passes ``MPI.COMM_NULL``).  It becomes
    usable once registered: passed to ``hvd.init(process_sets=[...])``, or given to
    ``hvd.add_process_set`` when dynamic process sets are on.

    Args:
        ranks_or_comm: the members' ranks in the job (any order, no repeats), or an mpi4py
            communicator.

    Raises:
        TypeError: neither a list of int ranks nor a communicator.
        ValueError: a rank is repeated.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks: Optional[List[int]] = None  # known once registered
            return
        try:
            ranks = [int(r) for r in ranks_or_comm]
        except (TypeError, ValueError):
            raise TypeError(
                f"ProcessSet expects a list of ranks or an mpi4py communicator, "
                f"got {ranks_or_comm!r}"
            ) from None
        if any(isinstance(r, bool) for r in ranks_or_comm):
            raise TypeError(f"ProcessSet ranks must be ints, got {ranks_or_comm!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks {ranks} repeat a rank")
        self.ranks = sorted(ranks)

    def size(self) -> Optional[int]:
        """How many ranks the set has (None before it is registered)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set: its position in ``ranks``; -1 when this
        process is not a member, None before the set is registered."""
        if self.process_set_id is None:
            return None
        me = basics.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> Optional[bool]:
        """Whether this process is a member (None before the set is registered)."""
        if self.process_set_id is None:
            return None
        return basics.rank() in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job; always registered, with id 0."""

    def __init__(self):
        self.process_set_id = 0
        self.mpi_comm = None

    @property
    def ranks(self) -> List[int]:
        return list(range(basics.size()))

    def size(self) -> int:
        return basics.size()

    def rank(self) -> int:
        return basics.rank()

    def included(self) -> bool:
        return True

    def _invalidate(self) -> None:
        pass  # the global set never goes away

    def __repr__(self):
        return "global_process_set"


global_process_set = _GlobalProcessSet()


class _Registered:
    __slots__ = ("process_set", "ranks", "runtime")

    def __init__(self, process_set: ProcessSet, ranks: List[int], runtime: Optional[Runtime]):
        self.process_set = process_set
        self.ranks = ranks
        self.runtime = runtime


class _Registry:
    """The sets registered since the last ``init()``, identical on every rank."""

    def __init__(self):
        self.lock = threading.RLock()
        self.sets: Dict[int, _Registered] = {}
        self.next_id = 1
        #: process sets may be added and removed after init()
        self.dynamic = False

    def reset(self) -> None:
        """End every set's runtime (at init() and shutdown())."""
        with self.lock:
            sets, self.sets = self.sets, {}
            self.next_id = 1
            self.dynamic = False
        for reg in sets.values():
            reg.process_set._invalidate()
            if reg.runtime is not None:
                try:
                    _stop(reg.runtime)
                except HvdliteInternalError as exc:  # shutdown goes on: the global runtime
                    log.warning("%s", exc)  # must still stop


_REGISTRY = _Registry()
basics.register_reset_hook(_REGISTRY.reset)


def _stop(runtime: Runtime) -> None:
    wait_s = runtime.config.op_timeout_s + 5.0
    if not runtime.stop(wait_s):
        raise HvdliteInternalError(
            f"{runtime.label}: its background thread did not exit within {wait_s:.0f}s; a "
            f"member of the set may be hung (see --op-timeout-seconds)"
        )


def set_dynamic(enabled: bool) -> None:
    _REGISTRY.dynamic = bool(enabled)


def dynamic_enabled() -> bool:
    return _REGISTRY.dynamic


def is_global(process_set) -> bool:
    return (
        process_set is None
        or process_set is global_process_set
        or getattr(process_set, "process_set_id", None) == 0
    )


def registered() -> List[ProcessSet]:
    with _REGISTRY.lock:
        return [reg.process_set for reg in _REGISTRY.sets.values()]


def find(ranks: Sequence[int]) -> Optional[ProcessSet]:
    """The registered set with exactly these ranks, if any."""
    with _REGISTRY.lock:
        for reg in _REGISTRY.sets.values():
            if reg.ranks == list(ranks):
                return reg.process_set
    return None


def register(process_set: ProcessSet, ranks: List[int]) -> ProcessSet:
    """Give ``process_set`` the next id and, on its members, start its runtime.

    Every rank calls this with the same sets in the same order (the caller agreed on
    them first), so ids match everywhere.

    Raises:
        HvdliteTimeoutError / HvdliteInternalError: a member did not connect.
    """
    parent = basics.runtime()
    with _REGISTRY.lock:
        set_id = _REGISTRY.next_id
        _REGISTRY.next_id += 1
        runtime = None
        if parent.rank in ranks:
            label = f"rank {parent.rank} (process set {set_id}: ranks {ranks})"
            if len(ranks) == 1:
                backend = LocalBackend(parent.config)
            else:
                backend = parent.backend.process_set(ranks, set_id)
            runtime = Runtime(parent.config, backend, ranks=ranks, label=label)
            runtime.start()
        process_set.process_set_id = set_id
        process_set.ranks = list(ranks)
        _REGISTRY.sets[set_id] = _Registered(process_set, list(ranks), runtime)
        log.debug("rank %d: process set %d = ranks %s", parent.rank, set_id, ranks)
    return process_set


def unregister(process_set: ProcessSet) -> None:
    """Forget a set; its members' runtime stops (its pending operations fail)."""
    with _REGISTRY.lock:
        reg = _REGISTRY.sets.pop(process_set.process_set_id, None)
    process_set._invalidate()
    if reg is not None and reg.runtime is not None:
        _stop(reg.runtime)


def runtime_of(process_set):
    """The runtime that carries ``process_set``'s collectives on this rank.

    Raises:
        ValueError: the set is not registered (never added, or removed), or this rank is
            not one of its members.
        HvdliteNotInitializedError: init() was not called.
    """
    if is_global(process_set):
        return basics.runtime()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set= expects an hvd.ProcessSet, got {type(process_set).__name__}")
    me = basics.runtime().rank
    reg = _REGISTRY.sets.get(process_set.process_set_id)
    if reg is None or reg.process_set is not process_set:
        raise ValueError(
            f"rank {me}: {process_set!r} is not registered in this job (add it "
            f"with hvd.add_process_set, or pass it to hvd.init(process_sets=...); "
            f"a removed set cannot be used)"
        )
    if reg.runtime is None:
        raise ValueError(
            f"rank {me} is not a member of process set "
            f"{process_set.process_set_id} (ranks {reg.ranks}); only its members "
            f"may call its collectives"
        )
    return reg.runtime
