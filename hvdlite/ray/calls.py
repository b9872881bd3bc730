"""The static executor's starter: calls on actors that already run.

A static :class:`~hvdlite.ray.ray_executor.RayExecutor` places its actors once, in
``start()``, and then runs one job per ``run()`` / ``execute()``.  Each such job goes
through the launcher's agent like any other: the host source is the executor's nodes
(fixed), and this starter "starts" the worker of a slot by calling the function on
that slot's actor; the call's end is the worker's exit (0 when it returned, 1 when it
raised, 137 when the actor died).  Stopping a worker kills its actor, as a failed job
of the executor always has: the executor must then be started again.
"""

import logging
import threading
from typing import Any, Callable, Dict, List, Sequence, Tuple

from hvdlite.ray.worker import RankFailed
from hvdlite.runner.hosts import SlotId, SlotInfo, slot_id
from hvdlite.runner.processes.workers import slot_env
from hvdlite.runner.starters.base import Starter

log = logging.getLogger(__name__)

#: the exit code of a worker whose actor (or node) died
ACTOR_DIED = 137


def outcome(ref) -> Tuple[int, Any, str]:
    """Wait for an actor call: ``(exit code, result, why it failed)`` -- 0 when it
    returned, 1 when the function raised (its error and traceback), 137 when the actor or
    its node died."""
    import ray

    try:
        return 0, ray.get(ref), ""
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        return 1, None, str(cause if isinstance(cause, RankFailed) else exc)
    except Exception as exc:  # noqa: BLE001 -- any other error: the actor or node died
        return ACTOR_DIED, None, f"{type(exc).__name__}: {exc}"


class ActorCallStarter(Starter):
    """Runs ``submit(actor, env)`` on the actor of each slot, ``env`` the slot's rank
    environment (``job_env()`` and its place); results and failures by slot."""

    def __init__(
        self,
        actors: Dict[SlotId, Any],
        submit: Callable[[Any, Dict[str, str]], Any],
        job_env: Callable[[], Dict[str, str]],
        on_exit: Callable[[], None] = lambda: None,
    ):
        self._actors, self._submit = dict(actors), submit
        self._job_env, self.on_exit = job_env, on_exit
        self._lock = threading.Lock()
        self._running: Dict[SlotId, Any] = {}
        self._exits: List[Tuple[SlotId, int]] = []
        #: slot id -> the call's result, for the workers that returned
        self._results: Dict[SlotId, Any] = {}
        #: slot id -> why the worker failed (its traceback, or the actor's death), in the
        #: order they failed
        self._failures: Dict[SlotId, str] = {}

    def results(self) -> Dict[SlotId, Any]:
        with self._lock:
            return dict(self._results)

    def failures(self) -> Dict[SlotId, str]:
        with self._lock:
            return dict(self._failures)

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        refused = {}
        env = self._job_env()
        for slot in slots:
            sid = slot_id(slot)
            actor = self._actors.get(sid)
            if actor is None:
                refused[sid] = f"no actor runs slot {sid[0]}:{sid[1]}"
                continue
            self._track(sid, actor, slot_env(slot, {}, env))
        return refused

    def _track(self, sid: SlotId, actor, env: Dict[str, str]) -> None:
        """Call ``submit(actor, env)`` for slot ``sid`` and watch the call on a thread."""
        ref = self._submit(actor, env)
        with self._lock:
            self._running[sid] = actor
        threading.Thread(
            target=self._watch, args=(sid, ref), daemon=True, name=f"ray-call-{sid[0]}-{sid[1]}"
        ).start()

    def _watch(self, sid: SlotId, ref) -> None:
        code, result, why = outcome(ref)
        with self._lock:
            if code == 0:
                self._results[sid] = result
            self._running.pop(sid, None)
            self._exits.append((sid, code))
            if code != 0:
                self._failures[sid] = why
        self.on_exit()

    def stop(self, ids: Sequence[SlotId]) -> None:
        import ray

        with self._lock:
            actors = [self._running[i] for i in ids if i in self._running]
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 -- already gone
                log.debug("ray: kill: %s", exc)

    def poll(self) -> List[Tuple[SlotId, int]]:
        with self._lock:
            out, self._exits = self._exits, []
        return out

    def stop_all(self) -> None:
        with self._lock:
            ids = list(self._running)
        self.stop(ids)
