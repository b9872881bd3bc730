"""Gloo through torch.distributed's ProcessGroupGloo, rendezvoused via the launcher's store.

The runtime builds its own process group and never touches torch.distributed's
default group, so user code may still call ``init_process_group`` (or use DDP).

Without shared memory, the per-cycle control MIN of a job of three or more
ranks runs by dissemination over Gloo's point-to-point exchange
(:func:`dissemination_min_`: ceil(log2 n) rounds instead of the ring's
2(n - 1) steps); elastic jobs keep Gloo's allreduce, because only a
collective's wait can be given up when the round changes.  The exchanges run
on an :class:`ExchangeGroup`; a cross-host group's indices are cross ranks, so
its members post "job rank, host" when it connects, and a failed or timed-out
exchange names the peer's job rank (and host) and ``--op-timeout-seconds``.

With shared memory (:mod:`.shm`), the control MIN and every allreduce go
through the host's segment, and across hosts over a Gloo group per local rank
(the control MIN by dissemination there too).  On one host the request
allgather, allgather, broadcast and alltoall also go through the segment;
across hosts they use the job's global Gloo group.  Process sets keep plain
Gloo: only the job's backend sets up a segment.
"""

import datetime
import logging
from typing import Any, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from hvdlite.common import config as cfg
from hvdlite.common.backend import gloo_waits, shared_buckets, shm, shm_leftovers
from hvdlite.common.backend.base import DONE, Backend, Waitable
from hvdlite.common.exceptions import (
    HvdliteConfigError,
    HvdliteInternalError,
    HvdliteRoundSupersededError,
    HvdliteTimeoutError,
)
from hvdlite.common.engine.message import ReduceOp
from hvdlite.common.net.kv import KVClient, Placement, arrival_key, round_prefix

log = logging.getLogger(__name__)

_REDUCE = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}
# dtypes Gloo cannot reduce, and the wider type they travel as
_WIDEN = {torch.int16: torch.int32}
#: the tag of hvdlite's point-to-point messages; nothing else sends on this private group
_P2P_TAG = 0x41444153
#: the tag of the control allreduce's exchanges (never concurrent with Adasum's: one thread)
_CONTROL_TAG = 0x43544C
#: the key, under the cross-host group's prefix, where a member posts "<job rank> <host>"
_MEMBER_KEY = "member/"


class ExchangeGroup(NamedTuple):
    """A process group as the point-to-point exchanges see it: this rank's index ``rank`` of
    ``size``, ``names[i]`` what member ``i`` is called in errors (its job rank, and host
    where known: a cross-host group's indices are not job ranks), ``who`` this rank's own
    name and ``timeout_s`` the op timeout (``--op-timeout-seconds``) every wait is bound by."""

    pg: Any
    rank: int
    size: int
    names: List[str]
    who: str
    timeout_s: float


class AuthenticatedStore(dist.Store):
    """A torch Store over the launcher's authenticated key-value service."""

    def __init__(self, client, timeout_s: float):
        super().__init__()
        self._client = client
        self._timeout_s = timeout_s

    def set(self, key, value):
        self._client.set(key, value if isinstance(value, bytes) else bytes(value))

    def get(self, key):
        return self._client.get(key)

    def add(self, key, value):
        return self._client.add(key, value)

    def check(self, keys):
        return self._client.check(list(keys))

    def wait(self, keys, timeout=None):
        # The store serves only the rendezvous at init, so --start-timeout bounds every wait.
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
        t = min(t, self._timeout_s) if t and t > 0 else self._timeout_s
        self._client.wait(list(keys), t)

    def compare_set(self, key, expected, desired):
        return self._client.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self._client.delete(key)

    def num_keys(self):
        return self._client.num_keys()

    def set_timeout(self, timeout):
        pass


class GlooBackend(Backend):
    """Collectives on a private ProcessGroupGloo."""

    name = "gloo"

    def __init__(
        self,
        config: cfg.Config,
        client: KVClient,
        place: Placement,
        job_ranks: List[int],
        who: str,
        joining: str,
    ):
        """Connect the ``place.size`` ranks that meet under ``client``'s prefix (a round's,
        or a process set's within it).  ``job_ranks`` are their job ranks in ``place``'s
        rank order, ``who`` names this rank in messages, and ``joining`` says what a rank
        that never arrives failed to do.  Closes ``client`` when it fails.

        Raises:
            HvdliteTimeoutError: a rank did not arrive within ``config.start_timeout_s``.
            HvdliteInternalError: Gloo could not connect the ranks.
        """
        self._config = config
        self._timeout_s = config.op_timeout_s
        self._client = client
        self.round = place.round
        gloo_waits.reap()
        self._watch = (
            gloo_waits.RoundWatch(
                client,
                place.round,
                who,
                gloo_waits.watcher_for(
                    (config.rendezvous_addr, config.rendezvous_port), lambda: _store_client(config)
                ),
            )
            if config.elastic
            else None
        )
        self.rank, self.size = place.rank, place.size
        self.local_rank, self.local_size = place.local_rank, place.local_size
        self.cross_rank, self.cross_size = place.cross_rank, place.cross_size
        self._job_ranks = list(job_ranks)
        self._who = who
        self.pg = None
        #: set by :meth:`_setup_shared_memory` (the job's backend only, never a set's)
        self._shm = None
        self._cross_pg = None
        self._cross_client: Optional[KVClient] = None
        self._peers: Optional[ExchangeGroup] = None
        self._cross_peers: Optional[ExchangeGroup] = None
        #: the cross-host part of the control MIN runs by dissemination (False: Gloo's ring
        #: allreduce; a benchmark knob, see benchmarks/control_plane.py --cross-min).  Not in
        #: elastic jobs: their waits must be let go of when the round changes, and only a
        #: collective's wait can be (see exchange)
        self.cross_min_by_dissemination = not config.elastic
        try:
            self._await_peers(client, config, joining)
            self._connect(client, config)
        except BaseException:
            client.close()
            raise

    @classmethod
    def for_job(cls, config: cfg.Config, last_round: int) -> "GlooBackend":
        """Join the first rendezvous round after ``last_round`` and connect its ranks.

        Raises:
            HvdliteConfigError: the rendezvous variables are missing (not under hvdlite-run).
            HvdliteTimeoutError: no round opened (within ``config.start_timeout_s``, or
                ``elastic_timeout_s`` in elastic mode), or a rank of the round did not arrive.
            HvdliteRemovedError: the newest round has no place for this process.
            HvdliteInternalError: Gloo could not connect the ranks.
        """
        if config.torch_store_addr is None and (
            config.rendezvous_addr is None
            or config.rendezvous_port is None
            or config.secret_key is None
        ):
            raise HvdliteConfigError(
                f"rank {config.rank}: size is {config.size} but {cfg.RENDEZVOUS_ADDR}, "
                f"{cfg.RENDEZVOUS_PORT} and {cfg.SECRET_KEY} are not all set; start the job "
                f"with hvdlite-run"
            )
        while True:
            try:
                return cls._join_round(config, last_round)
            except HvdliteRoundSupersededError as exc:
                # a peer of the round died while it formed and the launcher published the
                # next one: meet that round now rather than wait out --start-timeout here
                log.info(
                    "rank %s (%s): %s; joining round %d",
                    config.rank,
                    config.hostname,
                    exc,
                    exc.newest,
                )
                last_round = exc.newest - 1

    @classmethod
    def _join_round(cls, config: cfg.Config, last_round: int) -> "GlooBackend":
        client = _store_client(config)
        wait_s = config.elastic_timeout_s if config.elastic else config.start_timeout_s
        place = client.join_round(last_round, config.hostname, config.local_rank, wait_s)
        # every key of this round (ours and Gloo's) lives under the round's own prefix
        client.prefix = round_prefix(config.job_id, place.round)
        if config.elastic:
            client.round = place.round
        backend = cls(
            config, client, place, list(range(place.size)), f"rank {place.rank}", "reach hvd.init()"
        )
        try:
            backend._setup_shared_memory(client, config)
        except BaseException:
            backend.close()
            raise
        return backend

    def process_set(self, ranks, set_id):
        """A private ProcessGroupGloo among ``ranks``, rendezvoused under the round's
        ``set<id>/`` prefix of the same authenticated store."""
        config = self._config
        place = Placement(
            round=self.round,
            rank=ranks.index(self.rank),
            size=len(ranks),
            local_rank=self.local_rank,
            local_size=self.local_size,
            cross_rank=self.cross_rank,
            cross_size=self.cross_size,
        )
        client = _store_client(config)
        client.prefix = round_prefix(config.job_id, self.round) + f"set{set_id}/"
        if config.elastic:
            client.round = self.round
        return GlooBackend(
            config,
            client,
            place,
            ranks,
            f"rank {self.rank} (process set {set_id})",
            f"add process set {set_id} ({list(ranks)})",
        )

    # -- shared memory ----------------------------------------------------------------------
    def _setup_shared_memory(self, client, config: cfg.Config) -> None:
        """Use a shared segment between this host's ranks when every rank can.

        Every rank reaches the same verdict (two MIN-allreduces): first whether the job's
        layout allows it (enabled, several ranks on every host, the same number on each),
        then whether every host's segment was made and mapped.  Otherwise the job runs
        over Gloo alone, as before."""
        if self.local_rank == 0:
            _remove_dead_segments(self._who)
        layout = (
            config.shared_memory
            and self.local_size > 1
            and self.size == self.local_size * self.cross_size
            and shm.available()
        )
        if not self._agree(layout, "shared-memory layout"):
            return
        group = None
        try:
            group = self._open_segment(client, config)
        except HvdliteRoundSupersededError:
            raise
        except Exception as exc:  # e.g. /dev/shm full: every rank falls back to Gloo
            log.warning(
                "%s: shared memory between local ranks unavailable (%s); using Gloo alone",
                self._who,
                exc,
            )
        if not self._agree(group is not None, "shared-memory set-up"):
            if group is not None:
                group.close()
            return
        self._shm = group
        group.watch = self._watch
        self._map_bucket_arenas(client, config, group)
        if self.cross_size > 1:
            # the hosts' slices meet among the ranks with this local rank
            cross = _store_client(config)
            cross.prefix = round_prefix(config.job_id, self.round) + f"cross{self.local_rank}/"
            cross.round = client.round
            self._cross_client = cross
            cross.set(_MEMBER_KEY + str(self.cross_rank), f"{self.rank} {config.hostname}".encode())
            self._cross_pg = self._make_pg(cross, config, self.cross_rank, self.cross_size)
            self._cross_peers = ExchangeGroup(
                self._cross_pg,
                self.cross_rank,
                self.cross_size,
                _member_names(cross, self.cross_size, config.start_timeout_s),
                self._who,
                self._timeout_s,
            )
        log.debug(
            "%s: shared memory with %d local ranks (%s)",
            self._who,
            self.local_size,
            "hierarchical" if self._cross_pg is not None else "one host",
        )

    def _map_bucket_arenas(self, client, config: cfg.Config, group) -> None:
        """Zero-copy buckets: every local rank posts where its bucket arena is ("-": none, or
        ``--no-zero-copy``) and maps its peers'; used only when every rank of the job could
        (one more MIN-allreduce)."""
        tag = f"shm/{config.hostname}/{self.cross_rank}/arena/"
        own = shared_buckets.open_arena() if config.zero_copy else None
        client.set(tag + str(self.local_rank), own.ticket.encode() if own else b"-")
        keys = [tag + str(r) for r in range(self.local_size)]
        client.wait(keys, config.start_timeout_s)
        tickets = [client.get(k).decode() for k in keys]
        arenas = None
        if "-" not in tickets:
            try:
                arenas = shared_buckets.PeerArenas(tickets, self.local_rank, own)
            except OSError as exc:
                log.warning(
                    "%s: the local ranks' gradient buckets cannot be shared (%s); they are copied",
                    self._who,
                    exc,
                )
        if self._agree(arenas is not None, "zero-copy buckets"):
            group.use_arenas(arenas, own)
        elif arenas is not None:
            arenas.close()

    def _agree(self, flag: bool, what: str) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self._run(what, self.pg.allreduce([t], _min_opts()))
        return bool(t.item())

    def _open_segment(self, client, config: cfg.Config):
        """Local rank 0 creates the host's segment (nameless, see ``shm``) and posts where
        the others find it; they map it, and once all have (or failed), rank 0 closes the
        way in: the memory lives until the last of them exits."""
        tag = f"shm/{config.hostname}/{self.cross_rank}/"
        slot = shm.slot_bytes_for(config.fusion_chunk_bytes, config.inplace_threshold_bytes)
        wait_s = config.start_timeout_s
        if self.local_rank == 0:
            try:
                group = shm.SharedMemoryGroup.create(self.local_size, slot, [], self._timeout_s)
            except Exception:
                client.set(tag + "created", b"0")
                raise
            client.set(tag + "created", group.ticket.encode())
        else:
            client.wait([tag + "created"], wait_s)
            ticket = client.get(tag + "created")
            if ticket == b"0":
                raise HvdliteInternalError("local rank 0 could not create the segment")
            try:  # e.g. another container's /proc: tell rank 0 at once
                group = shm.SharedMemoryGroup.attach(
                    ticket.decode(), self.local_rank, self.local_size, slot, [], self._timeout_s
                )
            except Exception:
                client.set(tag + f"attached/{self.local_rank}", b"-1")
                raise
        client.set(tag + f"attached/{self.local_rank}", str(self.rank).encode())
        keys = [tag + f"attached/{r}" for r in range(self.local_size)]
        try:
            client.wait(keys, wait_s)
        finally:
            if self.local_rank == 0:
                group.unlink()
        group.job_ranks = [int(client.get(k)) for k in keys]
        if min(group.job_ranks) < 0:
            group.close()
            raise HvdliteInternalError(
                "a local rank could not map the segment (do this host's ranks share one /proc?)"
            )
        return group

    def _cross_allreduce(self, part, op) -> None:
        _widened_allreduce(self, self._cross_pg, "cross-host allreduce", part, op)

    def _cross_allreduce_start(self, part, op):
        """Start ``part``'s allreduce among the hosts; returns the call that waits for it
        (Gloo runs several collectives of a group at once, matched in the order started)."""
        wide = _WIDEN.get(part.dtype)
        target = part.to(wide) if wide is not None else part
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE[op]
        work = self._cross_pg.allreduce([target], opts)

        def wait():
            self._run("cross-host allreduce", work)
            if wide is not None:
                part.copy_(target)

        return wait

    def _cross_min(self, part, op) -> None:
        """The control vector's slice, MIN over the hosts: ceil(log2 hosts) exchanges."""
        dissemination_min_(self._cross_peers, part)

    def _one_host_shm(self):
        """The shared-memory group when it connects every rank of the job (one host)."""
        return self._shm if self._shm is not None and self.cross_size == 1 else None

    def _connect(self, client, config: cfg.Config) -> None:
        self.pg = self._make_pg(client, config, self.rank, self.size)
        self._peers = ExchangeGroup(
            self.pg,
            self.rank,
            self.size,
            [f"rank {r}" for r in self._job_ranks],
            self._who,
            self._timeout_s,
        )

    def _make_pg(self, client, config: cfg.Config, rank: int, size: int):
        store = AuthenticatedStore(client, config.start_timeout_s)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=config.op_timeout_s)
        opts._threads = config.gloo_threads
        if config.gloo_iface:
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=config.gloo_iface)]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        try:
            return gloo_waits.build(
                lambda: dist.ProcessGroupGloo(store, rank, size, opts),
                self._watch,
                "connection to its peers",
            )
        except HvdliteRoundSupersededError:
            raise
        except Exception as exc:
            if client.superseded_by is not None:  # the store's wait said so, not Gloo
                raise HvdliteRoundSupersededError(
                    f"{self._who}: round {self.round} was replaced by round "
                    f"{client.superseded_by} while Gloo connected",
                    client.superseded_by,
                ) from exc
            raise HvdliteInternalError(
                f"{self._who} ({config.hostname}): Gloo rendezvous failed: {exc}"
            ) from exc

    def newest_round(self) -> int:
        """The newest rendezvous round the launcher has opened (may be newer than ours);
        elastic jobs read it from the process's round watcher, without a request."""
        if self._watch is not None:
            return self._watch.newest()
        return self._client.newest_round()

    def _await_peers(self, client, config: cfg.Config, what: str) -> None:
        """Meet every rank at the store first, so a rank that never arrives is named."""
        client.set(arrival_key(self.rank), config.hostname.encode())
        try:
            client.wait([arrival_key(r) for r in range(self.size)], config.start_timeout_s)
        except HvdliteTimeoutError:
            missing = [
                self._job_ranks[r] for r in range(self.size) if not client.check([arrival_key(r)])
            ]
            raise HvdliteTimeoutError(
                f"{self._who} ({config.hostname}, rendezvous round {self.round}): ranks "
                f"{missing} did not {what} within {config.start_timeout_s:g}s "
                f"(--start-timeout); they may have failed before it, be running "
                f"different code, or still be preparing (loading data or building a model "
                f"before init() takes longer than that: raise --start-timeout)"
            ) from None

    def _run(self, what: str, work) -> None:
        try:
            if self._watch is None:
                work.wait()
            else:
                gloo_waits.wait(work, self._timeout_s, what, self._watch)
        except HvdliteRoundSupersededError:
            raise
        except Exception as exc:
            raise HvdliteInternalError(
                f"{self._who}: Gloo {what} failed ({exc}); a peer rank has probably "
                f"exited, or stopped responding for longer than --op-timeout-seconds "
                f"({self._timeout_s:g}s)"
            ) from exc

    def control_allreduce_min(self, vec):
        t = torch.from_numpy(vec)
        if self._shm is not None:
            # on the host through the segment, then (several hosts) among the hosts only,
            # not every rank, by dissemination: the latency grows with log2 of the hosts
            cross = None
            if self._cross_pg is not None:
                cross = (
                    self._cross_min if self.cross_min_by_dissemination else self._cross_allreduce
                )
            self._shm.allreduce_(t, ReduceOp.MIN, cross)
            return vec
        if self.size > 2 and self._watch is None:
            dissemination_min_(self._peers, t)
            return vec
        self._run("control allreduce", self.pg.allreduce([t], _min_opts()))
        return vec

    def _allgather_fixed(self, buf):
        local = self._one_host_shm()
        if local is not None and local.fits(buf.size):
            return local.allgather_fixed(buf)
        src = torch.from_numpy(buf)
        out = torch.empty(self.size * buf.size, dtype=torch.uint8)
        self._run("control allgather", self.pg._allgather_base(out, src))
        return out.numpy()

    def allreduce_(self, tensor, op):
        if self._shm is not None:
            cross, cross_start = self._crosses()
            self._shm.allreduce_(tensor, op, cross, cross_start=cross_start)
            return
        _widened_allreduce(self, self.pg, "allreduce", tensor, op)

    def allreduce_scaled_(self, tensor, op, prescale, postscale):
        if self._shm is None:
            super().allreduce_scaled_(tensor, op, prescale, postscale)
            return
        if self._shm.arenas is not None and self._zero_copy([tensor], op, prescale, postscale):
            return
        cross, cross_start = self._crosses()
        self._shm.allreduce_(tensor, op, cross, prescale, postscale, cross_start)

    def _crosses(self) -> tuple:
        """``(cross, cross_start)`` for the shared-memory group's collectives: the slice's
        reduction among the hosts, and its start (None, None on one host)."""
        if self._cross_pg is None:
            return None, None
        return self._cross_allreduce, self._cross_allreduce_start

    def _zero_copy(self, tensors, op, prescale, postscale) -> bool:
        """Reduce ``tensors`` where they lie when they are zero-copy buckets on every local
        rank (``shm.SharedMemoryGroup.zero_copy_``); False: nothing done."""
        return self._shm.zero_copy_(
            [t.view(-1) for t in tensors], op, prescale, postscale, *self._crosses()
        )

    def allreduce_scaled_async_(self, tensor, op, prescale, postscale):
        if self._shm is None:
            return super().allreduce_scaled_async_(tensor, op, prescale, postscale)
        self.allreduce_scaled_(tensor, op, prescale, postscale)
        return DONE

    def allreduce_scaled_many_async_(self, tensors, op, prescale, postscale):
        if (
            self._shm is not None
            and self._shm.arenas is not None
            and self._zero_copy(tensors, op, prescale, postscale)
        ):
            return [DONE] * len(tensors)  # all in one pipeline, across hosts too
        if self._shm is None or not self._shm.pipelines(self._cross_pg is not None):
            return super().allreduce_scaled_many_async_(tensors, op, prescale, postscale)
        self._shm.allreduce_many_(tensors, op, prescale, postscale, *self._crosses())
        return [DONE] * len(tensors)

    def shares_buckets(self):
        return self._shm is not None and self._shm.arenas is not None

    def pipeline_chunk_bytes(self, requested):
        if self._shm is None:
            return requested
        return min(requested, self._shm.piece_bytes(self._cross_pg is not None))

    def stage(self, dtype, count):
        return self._shm.stage(dtype, count) if self._shm is not None else None

    def allreduce_staged_(self, staged, op, scale):
        cross = self._cross_allreduce if self._cross_pg is not None else None
        return self._shm.allreduce_staged_(staged, op, scale, cross)

    def allreduce_async_(self, tensor, op):
        if self._shm is not None:
            self.allreduce_(tensor, op)
            return DONE
        if tensor.dtype in _WIDEN:
            return super().allreduce_async_(tensor, op)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE[op]
        return _Pending(self, self.pg.allreduce([tensor], opts))

    def allgather_bytes(self, send, counts):
        width = max(counts) if counts else 0
        if width == 0:
            return [send[:0] for _ in counts]
        local = self._one_host_shm()
        if local is not None and local.fits(width):
            return local.allgather_bytes(send, counts)
        if send.numel() < width:
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: send.numel()] = send
        else:
            padded = send
        out = torch.empty(self.size * width, dtype=torch.uint8)
        self._run("allgather", self.pg._allgather_base(out, padded))
        return [out[r * width : r * width + counts[r]] for r in range(self.size)]

    def broadcast_(self, tensor, root):
        local = self._one_host_shm()
        if local is not None:
            local.broadcast_(tensor, root)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        # as raw bytes: Gloo lacks some dtypes (int16), and a broadcast needs no arithmetic
        self._run("broadcast", self.pg.broadcast([tensor.view(-1).view(torch.uint8)], opts))

    def alltoall_bytes(self, send, send_counts, recv_counts):
        local = self._one_host_shm()
        if local is not None:
            # every rank must take the same path, but each knows only its own sends: agree
            # on the largest first (a few microseconds through the segment)
            most = torch.tensor([8 * self.size + sum(send_counts)], dtype=torch.int64)
            local.allreduce_(most, ReduceOp.MAX)
            if local.fits(int(most.item())):
                return local.alltoall_bytes(send, send_counts, recv_counts)
        out = torch.empty(sum(recv_counts), dtype=torch.uint8)
        work = self.pg.alltoall_base(
            out, send, list(recv_counts), list(send_counts), dist.AllToAllOptions()
        )
        self._run("alltoall", work)
        return out

    def sendrecv_(self, send, recv, peer):
        """Gloo's unbound-buffer send and recv, both posted before either is awaited (neither
        blocks), each bounded by the op timeout."""
        exchange(self._peers, send, recv, peer, peer, _P2P_TAG)

    def close(self):
        # a round whose wait was given up still has an operation pending in its groups:
        # they are kept referenced until it failed (gloo_waits.bury), not dropped here
        held = [
            x for x in (self.pg, self._cross_pg, self._peers, self._cross_peers) if x is not None
        ]
        # the exchange groups hold the process groups too: a group still referenced after its
        # shutdown is destroyed at interpreter exit, where Gloo aborts ("terminate called")
        self._peers = self._cross_peers = None
        group, self._shm = self._shm, None
        if group is not None:
            group.close()
        cross, self._cross_pg = self._cross_pg, None
        if cross is not None:
            try:
                cross.shutdown()
            except Exception as exc:
                log.debug("rank %d: Gloo shutdown (cross-host group): %s", self.rank, exc)
            self._cross_client.close()
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception as exc:  # already broken by a dead peer: nothing left to release
                log.debug("rank %d: Gloo shutdown: %s", self.rank, exc)
        self._client.close()
        if self._watch is not None and self._watch.gave_up:
            gloo_waits.bury(held, self._timeout_s + 5.0)


def _remove_dead_segments(who: str) -> None:
    """Every job's local rank 0 removes the named segments killed jobs left in /dev/shm."""
    removed = shm_leftovers.remove_dead_segments()
    if removed:
        log.info(
            "%s: removed %d shared-memory segment(s) of dead jobs from %s: %s",
            who,
            len(removed),
            shm.SHM_DIR,
            ", ".join(removed),
        )


def _store_client(config: cfg.Config):
    """A new client of the launcher's authenticated store (no prefix yet), or of torch's
    store when torchrun started the job."""
    if config.torch_store_addr is not None:
        from hvdlite.common.backend.torch_store_client import TorchStoreClient

        return TorchStoreClient(config)
    return KVClient(
        (config.rendezvous_addr, config.rendezvous_port),
        config.secret_key,
        timeout_s=config.start_timeout_s,
    )


def _member_names(client: KVClient, size: int, timeout_s: float) -> List[str]:
    """What a cross-host group's members are called: "rank <job rank> (<host>)", read from
    the keys every member posted before Gloo connected them (so all are there by now)."""
    keys = [_MEMBER_KEY + str(i) for i in range(size)]
    client.wait(keys, timeout_s)
    names = []
    for key in keys:
        rank, host = client.get(key).decode().split(" ", 1)
        names.append(f"rank {rank} ({host})")
    return names


def exchange(group: ExchangeGroup, send, recv, dst: int, src: int, tag: int) -> None:
    """Send ``send`` to member ``dst`` of ``group`` while receiving ``src``'s message into
    ``recv``; each wait is bound by the group's op timeout.

    The wait is never taken in slices (``gloo_waits``): a send or receive whose timed wait
    runs out breaks every connection of Gloo's context, so elastic jobs use collectives,
    not exchanges, for what runs every cycle.

    Raises:
        HvdliteInternalError: the exchange failed or timed out (names the peer and the flag).
    """
    works = []
    peer = src
    try:  # posting fails at once when the peer's connection is already closed
        if recv.numel():
            works.append((group.pg.recv([_as_bytes(recv)], src, tag), src))
        peer = dst
        if send.numel():
            works.append((group.pg.send([_as_bytes(send)], dst, tag), dst))
        for work, peer in works:
            if (
                gloo_waits.wait(work, group.timeout_s, f"exchange with {group.names[peer]}", None)
                is False
            ):
                raise HvdliteInternalError(
                    f"{group.who}: Gloo exchange with {group.names[peer]} was aborted"
                )
    except HvdliteInternalError:
        raise
    except Exception as exc:
        raise HvdliteInternalError(
            f"{group.who}: Gloo exchange with {group.names[peer]} failed ({exc}); the peer "
            f"has probably exited, or stopped responding for longer than "
            f"--op-timeout-seconds ({group.timeout_s:g}s)"
        ) from exc


def dissemination_min_(group: ExchangeGroup, t) -> None:
    """MIN of ``t`` over ``group`` in place, in ceil(log2 size) rounds of one exchange each,
    for any size: in round k every member sends what it has to member + 2^k and keeps the
    MIN with what member - 2^k sent.  Duplicated contributions (size not a power of two) do
    not change a MIN.  Gloo's ring allreduce needs 2 (size - 1) steps for the same vector.

    Raises:
        HvdliteInternalError: an exchange failed or timed out (see :func:`exchange`).
    """
    incoming = torch.empty_like(t)
    step = 1
    while step < group.size:
        exchange(
            group,
            t,
            incoming,
            (group.rank + step) % group.size,
            (group.rank - step) % group.size,
            _CONTROL_TAG,
        )
        torch.minimum(t, incoming, out=t)
        step <<= 1


class _Pending(Waitable):
    def __init__(self, backend, work):
        self._backend = backend
        self._work = work

    def wait(self):
        self._backend._run("allreduce", self._work)


def _widened_allreduce(backend, pg, what: str, tensor, op) -> None:
    """Allreduce on ``pg`` in place, through a wider copy for dtypes Gloo cannot reduce."""
    wide = _WIDEN.get(tensor.dtype)
    target = tensor.to(wide) if wide is not None else tensor
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE[op]
    backend._run(what, pg.allreduce([target], opts))
    if wide is not None:
        tensor.copy_(target)


def _as_bytes(tensor):
    """A contiguous tensor's storage as flat uint8 (send/recv need no arithmetic)."""
    return tensor.view(-1).view(torch.uint8)


def _min_opts():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts
