"""The Spark side of a job: what each Spark task runs on its executor.

A task registers with the driver's task service (:mod:`hvdlite.spark.pool`), then
waits for an order: ``run`` gives it its rank's environment, and the task calls the
user's function in its own Python worker with that environment applied (restored
afterwards: Spark reuses its workers).  The result goes back pickled (cloudpickle
when installed), a raised exception as its traceback.  While the function runs, a
thread beats every second; when the driver says ``stop`` or cannot be reached for
``DRIVER_LOST_S``, the task ends its own Python worker, so no rank outlives its job.

The service key arrives in the task's closure (Spark's own task serialization) and is
also the job key: it never crosses the task service's connection.
"""

import os
import socket
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteError
from hvdlite.common.net.service import Client
from hvdlite.runner.tasks.function_rank import dumps
from hvdlite.runner.tasks.nics import discover_nics

#: seconds between a running task's heartbeats
HEARTBEAT_S = 1.0
#: a task whose driver has not answered for this long ends its Python worker
DRIVER_LOST_S = 15.0
#: bound on one request to the task service
REQUEST_TIMEOUT_S = 30.0
#: the exit status a task's Python worker ends with when the driver stops it
STOPPED_EXIT = 143


def iface_of(ip: str) -> str:
    """The network interface holding ``ip`` here, or "" (Gloo then picks)."""
    for name, addrs in discover_nics().items():
        if ip in addrs:
            return name
    return ""


class _Beats:
    """Heartbeats of a running task; ends the process when the driver says stop or is gone."""

    def __init__(self, client: Client, task: int):
        self._client = client
        self._task = task
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"hvdlite-spark-beat-{task}"
        )

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(REQUEST_TIMEOUT_S)

    def _loop(self) -> None:
        last_answer = time.monotonic()
        while not self._done.wait(HEARTBEAT_S):
            try:
                reply, _ = self._client.request(
                    {"op": "beat", "task": self._task}, timeout_s=DRIVER_LOST_S
                )
            except (OSError, HvdliteError):
                if time.monotonic() - last_answer > DRIVER_LOST_S:
                    os._exit(STOPPED_EXIT)  # the job is gone: so is this rank
                continue
            last_answer = time.monotonic()
            if reply.get("order") == "stop" and not self._done.is_set():
                os._exit(STOPPED_EXIT)  # the driver ended this rank


def _call(
    fn: Callable, args: Sequence, kwargs: Dict[str, Any], env: Dict[str, str]
) -> Tuple[str, bytes, str]:
    """``fn`` with ``env`` applied to ``os.environ`` (restored afterwards); returns
    ``("result", pickled result, "")`` or ``("failure", b"", traceback text)``."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        result = fn(*args, **kwargs)
        return "result", dumps(result), ""
    except (Exception, SystemExit):  # the user's error, reported to the driver
        return "failure", b"", traceback.format_exc()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _leave_clean(succeeded: bool) -> None:
    """Spark reuses this Python worker: a rank that returned without ``shutdown()`` is shut
    down; one that raised with its runtime still up (its peers may be stuck in a
    collective with it) ends the worker, as a failed process would."""
    from hvdlite.common import basics

    if not basics.is_initialized():
        return
    if succeeded:
        basics.shutdown()
    else:
        os._exit(1)


def _forget_earlier_jobs() -> None:
    """Spark reuses Python workers across jobs: the rendezvous round this process last
    joined belongs to an earlier job's store, so a new job's rank starts from none (the
    round a later ``init()`` asks for is after the one it joined in *this* job)."""
    from hvdlite.common import basics

    basics.forget_rendezvous()


def serve_task(
    addr: Tuple[str, int],
    key: bytes,
    fn: Callable,
    args: Sequence,
    kwargs: Dict[str, Any],
    partition: int,
    tag: int,
    wait_s: float,
) -> int:
    """Register, wait up to ``wait_s`` for an order, run ``fn`` if told to; returns 0."""
    client = Client(addr, key, timeout_s=REQUEST_TIMEOUT_S, name="hvdlite.spark task service")
    try:
        reply, _ = client.request(
            {
                "op": "register",
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "partition": partition,
                "tag": tag,
            }
        )
        task, seen_as = int(reply["task"]), str(reply["address"])
        deadline = time.monotonic() + wait_s
        while True:
            reply, _ = client.request({"op": "order", "task": task}, timeout_s=REQUEST_TIMEOUT_S)
            order = reply.get("order")
            if order == "run":
                break
            if order in ("exit", "stop") or time.monotonic() > deadline:
                return 0
        env = {str(k): str(v) for k, v in reply.get("env", {}).items()}
        env[cfg.SECRET_KEY] = key.hex()
        iface = iface_of(seen_as)
        if iface:
            env.setdefault(cfg.GLOO_IFACE, iface)
        _forget_earlier_jobs()
        with _Beats(client, task):
            kind, blob, text = _call(fn, args, kwargs, env)
            client.request(
                {"op": kind, "task": task, "traceback": text}, blob, timeout_s=REQUEST_TIMEOUT_S
            )
        _leave_clean(kind == "result")
        return 0
    finally:
        client.close()


def partition_runner(
    addr: Tuple[str, int],
    key: bytes,
    fn: Callable,
    args: Sequence,
    kwargs: Optional[Dict[str, Any]],
    tag: int,
    wait_s: float,
) -> Callable[[int, Iterator], Iterator[int]]:
    """The function Spark runs on each partition (``mapPartitionsWithIndex``) of the
    Spark job ``tag``."""
    args, kwargs = tuple(args or ()), dict(kwargs or {})

    def run_partition(index: int, _rows: Iterator) -> Iterator[int]:
        yield serve_task(addr, key, fn, args, kwargs, index, tag, wait_s)

    return run_partition
