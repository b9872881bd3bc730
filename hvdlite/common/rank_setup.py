"""Start this rank and change its process sets: ``init``, ``add_process_set``,
``remove_process_set``.

``init`` starts the runtime (``basics.start_runtime``) and then registers the process sets
it was given; adding or removing a set while the job runs is a collective over the whole
job (two allgathers of the op layer, :mod:`hvdlite.common.ops`) in which every rank must
ask for the same change, so every rank reaches the same verdict and raises the same error.
"""

import json
from typing import List, Optional, Sequence

from hvdlite.common import arrays, basics
from hvdlite.common import config as cfg
from hvdlite.common import process_sets as _sets
from hvdlite.common.config import Config
from hvdlite.common.diagnostics.raised import noted
from hvdlite.common.diagnostics.recorder import NULL, Recorder
from hvdlite.common.ops import allgather_async, synchronize
from hvdlite.common.process_sets import ProcessSet

#: names of the job-wide exchanges that agree on a change of process sets
_AGREE_NAME = "hvdlite.process_sets"


def _set_ranks_seen_here(ps: ProcessSet) -> Optional[List[int]]:
    """The ranks this process says ``ps`` has; None when it cannot know (a communicator
    this process is not in)."""
    if ps.mpi_comm is None:
        return list(ps.ranks)
    backend = basics.runtime().backend
    if not hasattr(backend, "job_ranks_of"):
        raise ValueError(
            f"a ProcessSet made from an MPI communicator needs the MPI backend; "
            f"this job runs {backend.name!r} (give the ranks as a list)"
        )
    return sorted(backend.job_ranks_of(ps.mpi_comm)) or None


def _agree(kind: str, sets: Sequence[ProcessSet]) -> List[List[int]]:
    """Check that every rank asks for the same change; returns each set's ranks.

    A collective over the whole job (two allgathers), so every rank reaches the same
    verdict and raises the same error.

    Raises:
        ValueError: the ranks asked for different changes, or a set's ranks are not valid.
    """
    k = arrays.kind()
    me, n = basics.rank(), basics.size()
    mine = {"kind": kind, "sets": [_set_ranks_seen_here(ps) for ps in sets]}
    blob = json.dumps(mine).encode()
    lens = synchronize(
        allgather_async([k.tensor([len(blob)], "int64")], _AGREE_NAME + ".len", False)
    ).tolist()
    width = max(lens)
    row = k.zeros((1, width), "uint8")
    row[0, : len(blob)] = k.from_bytes(blob)
    rows = synchronize(allgather_async([row], _AGREE_NAME + ".data", False))
    asked = [json.loads(k.to_numpy(rows[r, : lens[r]]).tobytes()) for r in range(n)]
    shapes = {(a["kind"], len(a["sets"])) for a in asked}
    if len(shapes) > 1:
        said = "; ".join(
            f"rank {r}: {a['kind']} {len(a['sets'])} set(s)" for r, a in enumerate(asked)
        )
        raise ValueError(
            f"rank {me}: the ranks disagree on the process-set change ({said}); "
            f"every rank must add and remove the same sets in the same order"
        )
    agreed = []
    for i in range(len(sets)):
        views = {}
        for r, a in enumerate(asked):
            if a["sets"][i] is not None:
                views.setdefault(tuple(a["sets"][i]), []).append(r)
        if len(views) != 1:
            said = (
                "; ".join(f"ranks {rs} asked for {list(v)}" for v, rs in views.items())
                or "no rank is a member"
            )
            raise ValueError(
                f"rank {me}: {kind} process set: the ranks disagree on its members ({said})"
            )
        ranks = list(next(iter(views)))
        if not ranks or ranks[0] < 0 or ranks[-1] >= n:
            raise ValueError(
                f"rank {me}: {kind} process set {ranks}: ranks must be a "
                f"non-empty subset of 0..{n - 1}"
            )
        agreed.append(ranks)
    return agreed


def _dynamic_required(what: str) -> None:
    if not _sets.dynamic_enabled():
        twins = " or ".join(f"{t}=1" for t in cfg.horovod_twins(cfg.DYNAMIC_PROCESS_SETS))
        raise ValueError(
            f"{what}: dynamic process sets are off; start with "
            f"hvd.init(process_sets='dynamic') or set "
            f"{cfg.DYNAMIC_PROCESS_SETS}=1 ({twins})"
        )


@noted
def add_process_set(process_set) -> ProcessSet:
    """Register a process set while the job runs; returns it (with its id).

    A collective: every rank of the job calls it, with the same ranks, in the same order
    as its other process-set changes.  Needs dynamic process sets.

    Args:
        process_set: a :class:`ProcessSet`, or a list of ranks to make one of.

    Returns:
        The registered :class:`ProcessSet`.

    Raises:
        ValueError: dynamic process sets are off, the ranks disagree or are out of range,
            the set is already registered, or a set with the same ranks exists.
    """
    basics.runtime()
    _dynamic_required("add_process_set")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps!r} is already registered")
    [ranks] = _agree("add", [ps])
    if ranks == list(range(basics.size())):
        raise ValueError(
            f"add_process_set: ranks {ranks} are the whole job, which is hvd.global_process_set"
        )
    existing = _sets.find(ranks)
    if existing is not None:
        raise ValueError(
            f"add_process_set: a process set with ranks {ranks} already exists ({existing!r})"
        )
    return _sets.register(ps, ranks)


@noted
def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set added with :func:`add_process_set`; its members' pending operations
    on it fail.  A collective over the job, like adding.

    Args:
        process_set: the registered :class:`ProcessSet`.

    Returns:
        True once removed.

    Raises:
        ValueError: dynamic process sets are off, the set is the global one or not
            registered, or the ranks disagree.
    """
    basics.runtime()
    _dynamic_required("remove_process_set")
    if _sets.is_global(process_set):
        raise ValueError("remove_process_set: the global process set cannot be removed")
    if not isinstance(process_set, ProcessSet) or process_set not in _sets.registered():
        raise ValueError(f"remove_process_set: {process_set!r} is not a registered process set")
    _agree("remove", [process_set])
    _sets.unregister(process_set)
    return True


def init(
    comm=None,
    process_sets=None,
    *,
    dynamic_process_sets: Optional[bool] = None,
    config: Optional[Config] = None,
    recorder: Recorder = NULL,
) -> None:
    """Start hvdlite on this rank, as ``horovod.torch.init``.

    Idempotent while the runtime runs.  Every rank of the job must call it; it returns
    once this rank has joined the job's rendezvous.

    Args:
        comm: under MPI, the job's processes: an mpi4py communicator, or a list of
            ``MPI_COMM_WORLD`` ranks (``None``: all of them).
        process_sets: :class:`ProcessSet` objects to register now (every rank passes the
            same), or ``"dynamic"`` to allow :func:`add_process_set` later.
        dynamic_process_sets: allow :func:`add_process_set` / :func:`remove_process_set`
            (``None``: from the environment, ``HVDLITE_DYNAMIC_PROCESS_SETS`` or
            Horovod's name for it).
        config: a ready configuration (tests); ``None`` reads the environment.
        recorder: receives the background thread's phase boundaries (default: none).

    Raises:
        ValueError: ``comm`` does not fit the backend, or the sets are not valid.
    """
    static = []
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(
                f"hvd.init(process_sets={process_sets!r}): expected a list of "
                f"ProcessSet objects or 'dynamic'"
            )
        dynamic_process_sets = True
    elif process_sets is not None:
        static = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]
    if basics.is_initialized() and basics.current_runtime().running():
        return
    basics.start_runtime(config, recorder, comm)
    if dynamic_process_sets is None:
        dynamic_process_sets = basics.config().dynamic_process_sets
    _sets.set_dynamic(dynamic_process_sets)
    if static:
        agreed = _agree("add", static)
        if len({tuple(r) for r in agreed}) != len(agreed):
            raise ValueError(f"hvd.init(process_sets=...): two sets have the same ranks ({agreed})")
        for ps, ranks in zip(static, agreed):
            if ranks != list(range(basics.size())):
                _sets.register(ps, ranks)
            else:
                ps.process_set_id = 0
                ps.ranks = ranks
