"""The background thread: drain, agree, fuse, execute, complete.

One :class:`Runtime` per ``init()``.  User threads only enqueue and wait on
handles; only the background thread touches the backend.  Each cycle:

1. drain new entries from the :class:`TensorQueue`;
2. one MIN-allreduce of a small int32 vector agrees on everything cheap at
   once: whether anybody needs a full negotiation, the longest request payload,
   who is shutting down, rank 0's stall verdict and request for stacks (``stall_watch``,
   :mod:`hvdlite.common.diagnostics.stack_capture`), each rank's ready age (the straggler report,
   :mod:`hvdlite.common.diagnostics.stragglers`) and the response-cache bits.
   The same vector carries rank 0's live :class:`Parameters`, so a change
   (fusion threshold, cycle time, ...) takes effect on every rank in the same
   cycle;
3. if anybody has a request the cache cannot answer, every rank's unsent
   requests are allgathered and each rank runs the same :class:`Controller`
   on them; otherwise the slots whose bit survived are ready;
4. responses are fused (:func:`plan_fusion`) and executed in the same order
   everywhere; handles complete with values or errors.

When the ranks ask for different requests (one is still submitting), a
negotiation first waits up to :data:`_CONVERGE_US` for the lists to become the
same, so nothing needs to be allgathered.  Every rank decides alike from the
vector's longest-wait field; a joined rank never waits, and cache hits run
meanwhile.

:meth:`Runtime.stop` (``shutdown()``) puts this rank into the vector's "lowest
rank shutting down" field, so every rank leaves the loop in the same cycle;
the others fail their pending work with "rank R shut down".  Completion wakes
each handle through a lock of its own, and the names are forgotten before
their owners are woken, so a step can reuse them at once.

Phase boundaries go to a :class:`Recorder` (a no-op unless one is given).

Any exception in the loop is delivered to every pending handle, and later
calls raise it too: a failure never becomes a hang.
"""

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from hvdlite.common import arrays
from hvdlite.common.diagnostics import flight_recorder
from hvdlite.common.engine import fusion
from hvdlite.common.diagnostics import stragglers
from hvdlite.common.engine import control_vector as cv
from hvdlite.common.config import Config
from hvdlite.common.engine.controller import Controller, plan_fusion
from hvdlite.common.exceptions import HvdliteError, HvdliteInternalError
from hvdlite.common.engine.executor import Executor
from hvdlite.common.engine.message import Response, decode_requests, encode_requests
from hvdlite.common.diagnostics.metrics_counters import Counters
from hvdlite.common.engine.parameters import Parameters
from hvdlite.common.diagnostics.recorder import NULL, Recorder
from hvdlite.common.engine.response_cache import ResponseCache
from hvdlite.common.engine.stall_watch import StallWatch
from hvdlite.common.engine.tensor_queue import Entry, TensorQueue

log = logging.getLogger(__name__)

_INT_MAX = cv.INT_MAX
# control vector layout (control_vector.py): [need_nothing_new, -payload_len, stall_cutoff,
#  params_version, stacks_id, stacks_age, params[W], leaving, ready-age summary,
#  request digests, packed cache bits]
_NEED, _LEN, _STALL, _PVER, _PARAMS = cv.NEED, cv.LEN, cv.STALL, cv.PVER, cv.PARAMS
_PARAMS_END = cv.LEAVING
#: a cache hit not executed after this long is sent through full negotiation instead,
#: so the stall inspector sees it
_CACHE_PATIENCE_S = 1.0
#: how long the loop sleeps when this rank has nothing pending (a submission wakes it at once)
_IDLE_WAIT_S = 0.05
#: how long a negotiation whose ranks ask for different requests waits for the lists to become
#: the same (a rank still submitting), so that it needs no allgather; after that it allgathers
_CONVERGE_US = 5000


class Runtime:
    """Owns the queue, the controller, the cache and the backend of one init()."""

    def __init__(
        self,
        config: Config,
        backend,
        recorder: Recorder = NULL,
        ranks: Optional[List[int]] = None,
        label: Optional[str] = None,
    ):
        """``ranks`` are the job ranks of a process set's members, in set-rank order (None:
        the whole job); messages name job ranks through it.  ``label`` names this runtime
        in messages and its thread."""
        self.config = config
        self.backend = backend
        self.rank, self.size = backend.rank, backend.size
        self.ranks = list(ranks) if ranks is not None else list(range(self.size))
        self.label = label or f"rank {self.rank}"
        self.queue = TensorQueue()
        self.controller = Controller(self.size, ranks)
        self.cache = ResponseCache(config.cache_capacity)
        #: the live parameters every rank applies (changed only through the control vector)
        self.params = Parameters.from_config(config)
        self._params_version = 0
        self._proposed = (0, self.params)  # rank 0: (version, parameters) it offers
        self._rec = recorder if recorder.active else None
        self._next_rec: Optional[Recorder] = None  # set_recorder's, taken at a cycle start
        self.executor = Executor(backend, fusion.FusionBuffers(), self.params, self._rec)
        self._unsent: Dict[str, Entry] = {}  # drained, not yet negotiated or executed
        self._sent: Dict[str, Entry] = {}  # in the controller's table
        self._wake = threading.Event()  # a submission arrived
        self._flush = threading.Event()  # a user waits: stop gathering submissions
        self._progress = False  # the last cycle negotiated or executed
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._cycle = 0
        # fusion plans of cache-hit cycles, keyed by (cache version, parameters, slots)
        self._plan_memo: Dict[tuple, list] = {}
        self._done: list = []  # (entry, result, error) of the running group
        self._set_up_vector(config.cache_capacity)
        self._set_up_diagnosis(config, ranks)
        name = f"hvdlite-background-r{self.ranks[self.rank]}"
        if ranks is not None:
            name += f"-set{'-'.join(map(str, self.ranks))}"
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _set_up_vector(self, cache_capacity: int) -> None:
        """The control vector's layout (see ``_NEED``) and the template every cycle's vector
        starts from (one copy per cycle instead of several fills)."""
        self._words = cv.words_for(cache_capacity)
        self._vec_len = cv.length(cache_capacity)
        self._ready_age = stragglers.NOT_PENDING  # this rank's entry of the next vector
        self._completed = False  # the last cycle executed responses
        self._leaving = False  # this rank's vector said it shuts down
        self._vec_template = cv.template(cache_capacity)

    def _set_up_diagnosis(self, config: Config, ranks: Optional[List[int]]) -> None:
        """The flight recorder, stall stacks, straggler tracking and metrics counters."""
        #: this process's flight recorder (None: off), this runtime's key in it, and the
        #: (group, entries) on the wire while a group executes
        self._flight = flight_recorder.current()
        self.flight_key = "global" if ranks is None else "ranks " + ",".join(map(str, self.ranks))
        self._flight_running: Optional[tuple] = None
        if self._flight is not None:
            self._flight.watch(self)
        #: stall warnings, rank 0's verdict and the stack requests (``stall_watch``)
        self.stalls = StallWatch(config, self.controller, self.rank, self.ranks, self.hurry)
        # the job's runtime only: users' requests for every rank's stacks
        self._poller = self.stalls.poller(self._liveness) if ranks is None else None
        self._stragglers = (
            stragglers.StragglerTracker(
                self.ranks,
                config.straggler_window_s,
                stragglers.announcer(config),
                "" if ranks is None else self.label,
            )
            if self.rank == 0 and self.size > 1
            else None
        )
        #: counters for hvdlite-run --metrics-port (None: metrics off; the job's runtime only)
        self.metrics = (
            Counters(config.fusion_threshold_bytes)
            if config.metrics_port and ranks is None and config.rendezvous_addr
            else None
        )
        if self.metrics is not None:
            self.metrics.stragglers = self._stragglers

    def _liveness(self) -> dict:
        """What this rank's poller tells the launcher each second: its round and how many
        cycles the background thread has run (the launcher's progress counter)."""
        return {"round": int(getattr(self.backend, "round", -1)), "progress": self._cycle}

    # -- user-thread side -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        if self._poller is not None:
            self._poller.start()

    def enqueue(self, entries: List[Entry]) -> None:
        if self._error is not None:
            raise self._error
        self.queue.push(entries, time.monotonic())
        if not self._wake.is_set():
            self._wake.set()

    def enqueue_one(self, entry: Entry) -> None:
        """:meth:`enqueue` of one entry (the per-op fast path)."""
        if self._error is not None:
            raise self._error
        self.queue.push_one(entry, time.monotonic())
        if not self._wake.is_set():
            self._wake.set()

    def propose_parameters(self, **changes) -> Parameters:
        """Rank 0 only: change live parameters; every rank applies them in one later cycle.

        Returns the proposed set.  Safe to call from any thread.

        Raises:
            HvdliteConfigError: an unknown name or a bad value.
            ValueError: called on a rank other than 0 (only rank 0's proposal travels).
        """
        if self.rank != 0:
            raise ValueError(
                f"rank {self.rank}: only rank 0 may change live parameters "
                f"(every rank applies rank 0's values in the same cycle)"
            )
        version, current = self._proposed
        params = current.replace(**changes)
        self._proposed = (version + 1, params)
        self.hurry()
        return params

    def set_recorder(self, recorder: Recorder) -> None:
        """Replace the recorder (a timeline started or stopped at run time).  The background
        thread switches at its next cycle start, so no group is reported half.  Any thread."""
        self._next_rec = recorder
        self.hurry()

    def recorder_switched(self) -> bool:
        """True once the background thread took the last :meth:`set_recorder`'s recorder."""
        return self._next_rec is None

    def _take_recorder(self) -> None:
        rec, self._next_rec = self._next_rec, None
        self._rec = rec if rec.active else None
        self.executor.set_recorder(self._rec)

    def running(self) -> bool:
        return self._thread.is_alive()

    def error(self) -> Optional[BaseException]:
        return self._error

    def stop(self, timeout_s: float) -> bool:
        """Ask every rank to stop (via the control vector) and join; True if it exited."""
        self._stop.set()
        self._flush.set()
        self._wake.set()
        if self._poller is not None:
            self._poller.stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- background thread ----------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.executor.enter_thread()
            while self._cycle_once():
                self._pace()
        except BaseException as exc:  # delivered to every handle, never swallowed
            if isinstance(exc, HvdliteError):
                err = exc
            else:
                err = HvdliteInternalError(
                    f"{self.label}: the background thread failed: {type(exc).__name__}: {exc}"
                )
                err.__cause__ = exc
            log.debug("rank %d: background loop ended with %s", self.rank, err)
            self._fail_all(err, dump=True)
        finally:
            if self._poller is not None:
                self._poller.stop()
            self.executor.forget()  # its views of shared memory go before the mapping
            self.backend.close()

    def _pace(self) -> None:
        """Wait until the next cycle is worth running.

        Work that arrived is gathered for up to one cycle time, so a burst of submissions
        negotiates and fuses together; a user waiting on a handle (:meth:`hurry`) ends the
        gathering at once.  After a cycle that negotiated or executed something, the next
        one starts at once (the peers are active; this rank just blocks in the control
        collective until they arrive).  An empty cycle is followed by a gap of one cycle
        time, so jobs whose ranks wait on each other do not spin the control plane; a rank
        with nothing pending sleeps until a submission (peers' shutdowns are still seen
        within :data:`_IDLE_WAIT_S`)."""
        period = self.params.cycle_time_ms / 1000.0
        wake = self._wake
        if self._stop.is_set():
            pass
        elif self.queue.has_incoming():
            self._flush.wait(period)
        elif self._unsent or self._sent:
            if not self._progress and wake.wait(period) and self.queue.has_incoming():
                self._flush.wait(period)
        elif wake.wait(_IDLE_WAIT_S) and not self._stop.is_set():
            self._flush.wait(period)
        wake.clear()
        self._flush.clear()

    def hurry(self) -> None:
        """A user thread waits on one of this runtime's handles: run the next cycle now
        instead of gathering more submissions.  Any thread."""
        if not self._flush.is_set():
            self._flush.set()
            self._wake.set()

    def _fail_all(self, err: BaseException, dump: bool = False) -> None:
        """Fail every pending handle with ``err``; the flight recorder is written when
        ``dump`` or when operations were still pending (a peer left in the middle)."""
        self._error = err
        left = self.queue.close(err)
        for entry in left:
            entry.handle.fail_one(err)
        self._unsent.clear()
        self._sent.clear()
        if self._flight is not None and (dump or left):
            self._flight.failed(self.flight_key, left, err)
            flight_recorder.dump(f"{self.label}: {err}")

    def _cycle_once(self) -> bool:
        """One cycle: drain, agree, negotiate or take the cache's fast path, execute.
        False once the runtime has ended (this rank or a peer shut down)."""
        self._cycle += 1
        now = time.monotonic()
        if self._next_rec is not None:
            self._take_recorder()
        self._drain(now)
        oldest = self._oldest_pending()
        vec, hits, payload = self._control_vector(now)
        agreed = self._agree(vec)
        if agreed is None:
            return False
        self._track_readiness(agreed, oldest)
        self.stalls.answer(agreed, self._cycle)
        stalled = self._stall_failures(agreed)
        negotiate = agreed[_NEED] == 0 and (
            cv.uniform(agreed) or cv.longest_wait_us(agreed) >= _CONVERGE_US
        )
        if negotiate:
            responses = self._negotiate(agreed, payload, stalled)
            if self.metrics is not None:
                self._count_cycle(now, oldest)
            self._execute(responses)
        else:
            if self.metrics is not None:
                self._count_cycle(now, oldest)
            self._execute(stalled)  # stall errors, if any, first
            self._execute_cache_hits(agreed, hits)
        self.stalls.check(now)
        self._progress = negotiate or self._completed
        return True

    def _drain(self, now: float) -> None:
        """Move new submissions into the unsent table (the recorder sees each one)."""
        rec = self._rec
        if rec is None:
            unsent = self._unsent
            for entry in self.queue.drain():
                unsent[entry.request.name] = entry
            return
        rec.cycle(self._cycle, now)
        for entry in self.queue.drain():
            self._unsent[entry.request.name] = entry
            rec.queued(
                entry.request.name,
                entry.request.op.name.lower(),
                entry.enqueued_at,
                getattr(entry.tensor, "nbytes", 0),
            )

    def _oldest_pending(self) -> Optional[float]:
        """When this rank's oldest pending submission was made (None: nothing pending);
        O(1): the tables keep submission order."""
        sent, unsent = self._sent, self._unsent
        if not sent:
            return next(iter(unsent.values())).enqueued_at if unsent else None
        oldest = next(iter(sent.values())).enqueued_at
        if unsent:
            return min(oldest, next(iter(unsent.values())).enqueued_at)
        return oldest

    def _track_readiness(self, agreed: np.ndarray, oldest: Optional[float]) -> None:
        """The straggler report's input: every rank's ready age at the previous agreement
        (rank 0 tallies it if that cycle completed work), and this rank's for the next."""
        agreed_at = time.monotonic()
        if self._completed and self._stragglers is not None:
            newest, youngest, oldest_age = cv.read_ages(agreed, self.size)
            if oldest_age < stragglers.NOT_PENDING:
                late = self._stragglers.observe_summary(newest, youngest, oldest_age, agreed_at)
                if late is not None and self._rec is not None:
                    self._rec.late(agreed_at, self.ranks[late[0]], late[1])
        self._completed = False
        self._ready_age = (
            stragglers.NOT_PENDING if oldest is None else stragglers.ready_age_us(oldest, agreed_at)
        )

    def _count_cycle(self, start: float, oldest: Optional[float]) -> None:
        """Metrics: this cycle's agreement time (when this rank had work), and rank 0's
        count of stalled tensors about once a second."""
        m = self.metrics
        now = time.monotonic()
        if oldest is not None:
            m.negotiated(now - start)
        if self.rank == 0 and now - m.stall_counted_at > 1.0:
            m.stall_counted_at = now
            m.stalled = len(self.controller.stalled(self.config.stall_check_warning_time_s))

    def _look_up_cache(self, now: float) -> Tuple[bool, List[int], int]:
        """The unsent requests against the response cache.

        Returns ``(need_full, slots, bound)``: whether this rank needs a full negotiation
        (a miss, or it has joined), the cache slots it hit, and the wire bytes of those
        hits (its payload should a peer force a negotiation)."""
        need_full = bool(self.controller.joined) and self.rank in self.controller.joined
        table = self.controller.table
        slots = []
        bound = 0
        use_cache = self.params.cache_enabled
        lookup = self.cache.lookup
        recent = now - _CACHE_PATIENCE_S
        for name, entry in self._unsent.items():
            slot = -1
            if use_cache and entry.enqueued_at > recent and name not in table:
                slot = lookup(entry.request)
            if slot < 0:
                need_full = True
            else:
                slots.append(slot)
                bound += entry.wire  # computed once, at submission
        return need_full, slots, bound

    def _control_vector(self, now: float) -> Tuple[np.ndarray, List[int], Optional[bytes]]:
        """What this rank brings to the agreement.

        Returns ``(vector, slots, payload)``: the control vector (layout at ``_NEED``), the
        cache slots this rank hit, and its encoded requests when it needs a negotiation
        (else None: encoded only if a peer forces one)."""
        need_full, slots, bound = self._look_up_cache(now)
        vec = self._vec_template.copy()
        cv.put_age(vec, self._ready_age, self.rank, self.size)
        if slots:
            cv.put_slots(vec, slots, self._words)
        if need_full:
            vec[_NEED] = 0
        if self.rank == 0:
            self.stalls.put_in(vec, self._cycle)
            version, proposed = self._proposed
            vec[_PVER] = version
            vec[_PARAMS:_PARAMS_END] = proposed.encode()
        else:
            vec[_STALL] = _INT_MAX
            vec[_PVER:_PARAMS_END] = _INT_MAX
        if self._stop.is_set():
            vec[cv.LEAVING] = self.rank
            self._leaving = True
        payload = None
        if need_full:
            payload = encode_requests([e.request for e in self._unsent.values()])
            vec[_LEN] = -len(payload)
            cv.put_digest(vec, payload)
            unsent = self._unsent
            cv.put_waited(
                vec,
                int((now - next(iter(unsent.values())).enqueued_at) * 1e6)
                if unsent and not self.controller.joined
                else _INT_MAX,
            )
        elif bound:
            # every rank reports at least what it would send, so the allgather buffer fits
            # the payload we only encode if some other rank forces a negotiation
            vec[_LEN] = -(bound + 2)
        return vec, slots, payload

    def _agree(self, vec: np.ndarray) -> Optional[np.ndarray]:
        """MIN-allreduce every rank's vector and apply rank 0's parameters.  None, after
        failing every pending handle, once any rank shuts down: that ends the runtime
        everywhere."""
        agreed = self.backend.control_allreduce_min(vec)
        if agreed[_PVER] != self._params_version:
            self._apply_parameters(
                int(agreed[_PVER]), Parameters.decode(agreed[_PARAMS:_PARAMS_END])
            )
        leaving = int(agreed[cv.LEAVING])
        if leaving == _INT_MAX:
            return agreed
        if not self._leaving:
            err = HvdliteInternalError(
                f"{self.label}: rank {self.ranks[leaving]} shut down (hvd.shutdown(), "
                f"exit, or removal of the process set) while this rank was still running; "
                f"pending and later operations fail"
            )
        else:
            err = HvdliteInternalError(f"{self.label}: hvdlite was shut down")
        self._fail_all(err)
        return None

    def _stall_failures(self, agreed: np.ndarray) -> List[Response]:
        """Error responses for the tensors rank 0 found stalled past the shutdown time."""
        if agreed[_STALL] == _INT_MAX:
            return []
        # rank 0 sent an age in cycles (every rank counts cycles alike): a cycle number
        # itself would overflow the int32 vector after 2^31 cycles
        failed = self.controller.fail_older_than(self._cycle - int(agreed[_STALL]))
        if failed and self._flight is not None:
            flight_recorder.dump(
                f"{self.label}: stall past the shutdown time: "
                f"{', '.join(r.name for r in failed[:8])}"
            )
        return failed

    def _negotiate(
        self, agreed: np.ndarray, payload: Optional[bytes], responses: List[Response]
    ) -> List[Response]:
        """Full negotiation: allgather every rank's unsent requests and run the controller
        on them; returns ``responses`` extended by the controller's, in order."""
        if cv.uniform(agreed):
            # every rank asks for exactly these requests: nothing needs to travel
            mine = [e.request for e in self._unsent.values()]
            self._sent.update(self._unsent)
            self._unsent = {}
            responses = responses + self.controller.ingest_uniform(mine, self._cycle)
        else:
            if payload is None:
                payload = encode_requests([e.request for e in self._unsent.values()])
            gathered = self.backend.control_allgather(payload, int(-agreed[_LEN]))
            self._sent.update(self._unsent)
            self._unsent = {}
            requests = [decode_requests(p) for p in gathered]
            responses = responses + self.controller.ingest(requests, self._cycle)
        rec = self._rec
        if rec is not None:
            end = time.monotonic()
            for resp in responses:
                rec.negotiated(resp.name, end, resp.waited_for)
        return responses

    def _execute_cache_hits(self, agreed: np.ndarray, hits: List[int]) -> None:
        """The fast path: run the cached responses of the slots every rank hit (this rank's
        ``hits``).  Words of the bit vector in which the ranks differ take a second, small
        MIN-allreduce of their bits, on every rank alike (control_vector.py)."""
        ragged = cv.ragged_words(agreed, self._words)
        second = None
        if len(ragged):
            second = self.backend.control_allreduce_min(cv.own_bits(hits, ragged))
        elif not hits:
            return
        ready = cv.ready_slots(agreed, self._words, ragged, second)
        if not ready:
            return
        cached = [self.cache.response(s) for s in ready]
        rec = self._rec
        if rec is not None:
            end = time.monotonic()
            for resp in cached:
                rec.negotiated(resp.name, end, ())
        self._execute(cached, tuple(ready))

    def _apply_parameters(self, version: int, params: Parameters) -> None:
        """Switch to rank 0's parameters; runs in the same cycle on every rank."""
        self._params_version = version
        self.params = params
        self.executor.params = params
        if self._rec is not None:
            self._rec.parameters(self._cycle, params)
        log.debug("rank %d: cycle %d: live parameters now %s", self.rank, self._cycle, params)

    def _execute(self, responses: List[Response], cached_slots=None) -> None:
        if not responses:
            return
        self._completed = True
        m = self.metrics
        if m is not None:
            m.responses(len(responses), cached_slots is not None)
        entries = self._take_entries(responses, cached_slots is not None)
        cache = self.cache
        groups = None
        if cached_slots is not None:
            key = (cache.version, self._params_version, cached_slots)
            groups = self._plan_memo.get(key)
        if groups is None:
            groups = plan_fusion(responses, self.params.fusion_threshold_bytes)
            if cached_slots is not None:
                if len(self._plan_memo) > 64:
                    self._plan_memo.clear()
                self._plan_memo[key] = groups
        done = self._done
        rec = self._rec
        fl = self._flight
        for group in groups:
            if fl is not None:
                self._flight_running = (group, entries)
            start = time.monotonic() if m is not None else 0.0
            self.executor.run(group, entries, self._collect, self._collect_error)
            end = time.monotonic() if m is not None else 0.0
            # forget the names before waking their owners, who may reuse them at once
            self.queue.finish([e.request.name for e, _, _ in done])
            for entry, result, err in done:
                if err is None:
                    entry.handle.complete_one(entry.index, result)
                else:
                    entry.handle.fail_one(err)
            if rec is not None:
                t_done = time.monotonic()
                for entry, _, err in done:
                    rec.done(entry.request.name, t_done, err)
            if fl is not None:  # after the handles: off the waiting user's path
                fl.completed(self.flight_key, self._cycle, group, done)
            if m is not None:  # likewise
                m.executed(group, end - start)
            done.clear()
        self._flight_running = None

    def _take_entries(self, responses: List[Response], cached: bool) -> Dict[str, Entry]:
        """This rank's entries of ``responses`` (out of the pending tables), and the cache
        brought up to date: touched for cache hits, filled or erased after a negotiation."""
        entries: Dict[str, Entry] = {}
        cache = self.cache
        sent_pop, unsent_pop = self._sent.pop, self._unsent.pop
        if cached:  # the steady state: one tight loop
            cache.touch_all(responses)
            for resp in responses:
                name = resp.name
                entry = sent_pop(name, None) or unsent_pop(name, None)
                if entry is not None:
                    entries[name] = entry
            return entries
        store = self.params.cache_enabled
        for resp in responses:
            name = resp.name
            entry = sent_pop(name, None) or unsent_pop(name, None)
            if entry is not None:
                entries[name] = entry
            if resp.cacheable:
                resp.nbytes = _nbytes(resp)
                if store:
                    cache.put(resp, entry.request if entry is not None else None)
            elif resp.error is not None:
                cache.erase(name)
        return entries

    def _collect(self, entry: Entry, result) -> None:
        self._done.append((entry, result, None))

    def _collect_error(self, entry: Entry, err: BaseException) -> None:
        self._done.append((entry, None, err))

    def flight_pending(self) -> List[Tuple[str, Entry, int]]:
        """``(state, entry, cycle)`` of every operation submitted and not completed, for a
        flight-recorder dump (any thread; a copy the background thread disturbed is
        retried, and after five tries the dump goes without them)."""
        for _ in range(5):
            try:
                out = [("queued", e, -1) for e in self.queue.incoming()]
                out += [("queued", e, -1) for e in list(self._unsent.values())]
                out += [("negotiated", e, -1) for e in list(self._sent.values())]
                running = self._flight_running
                if running is not None:
                    group, entries = running
                    out += [
                        ("in collective", entries[r.name], self._cycle)
                        for r in group
                        if r.name in entries
                    ]
                return out
            except RuntimeError:  # a table changed size while copied
                continue
        return []


def _nbytes(resp: Response) -> int:
    return arrays.numel(resp.shape) * arrays.itemsize(resp.dtype)
