"""Worker side of :func:`hvdlite.run`: ``python -m hvdlite.runner.tasks.function_rank``.

Each rank fetches ``(function, args, kwargs)`` from the caller's function
service, runs it and sends back the pickled result, or the traceback if it
raised.  Every message is a frame of :mod:`hvdlite.common.net` signed with the
service's key (from the environment, never a command line) and verified before
a byte of it is decoded, so nothing unauthenticated is ever unpickled, here or
in the caller.  The rank exits 0 after a result and 1 after a failure, so the
launcher ends the other ranks as it does for any failed rank.
"""

import os
import pickle
import sys
import traceback
from typing import Any, List, Mapping, Tuple

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteError
from hvdlite.common.net.service import Client
from hvdlite.runner.processes.rank_output import mpi_rank

try:  # cloudpickle carries lambdas and closures by value
    import cloudpickle
except ImportError:  # pragma: no cover - depends on the installation
    cloudpickle = None

MODULE = "hvdlite.runner.tasks.function_rank"
#: bound on reaching one candidate address of the caller
CONNECT_TIMEOUT_S = 5.0
#: bound on one transfer (a function or result may be large)
TRANSFER_TIMEOUT_S = 120.0
#: exit code of a rank that could not reach the caller at all
EXIT_NO_SERVICE = 2


def dumps(obj: Any) -> bytes:
    """Pickle with cloudpickle when it is installed (functions by value), else pickle."""
    if cloudpickle is not None:
        return cloudpickle.dumps(obj)
    return pickle.dumps(obj)


def loads(data: bytes) -> Any:
    """Unpickle bytes that arrived in a verified frame (cloudpickle output is plain pickle)."""
    return pickle.loads(data)


def this_rank(environ: Mapping[str, str]) -> int:
    """The rank hvdlite-run gave this process, or MPI's under ``--mpi``.

    Raises:
        HvdliteConfigError: neither the launcher nor MPI says which rank this is.
    """
    raw = environ.get(cfg.RANK)
    if raw:
        return int(raw)
    return mpi_rank(environ)


def _candidates(environ: Mapping[str, str]) -> List[Tuple[str, int]]:
    """The caller's addresses to try: the rendezvous host first (hvdlite-run chose it as
    reachable from every host), then every address the caller listed."""
    port = int(environ[cfg.RUN_FUNC_PORT])
    hosts = [environ.get(cfg.RENDEZVOUS_ADDR, "")]
    hosts += environ.get(cfg.RUN_FUNC_ADDRS, "").split(",")
    seen: List[Tuple[str, int]] = []
    for host in hosts:
        host = host.strip()
        if host and (host, port) not in seen:
            seen.append((host, port))
    return seen


def _connect(environ: Mapping[str, str], key: bytes) -> Tuple[Client, bytes]:
    """A client of the caller's service and the pickled function it sent.

    Raises:
        ConnectionError: no candidate address answered (names them all).
    """
    errors = []
    for addr in _candidates(environ):
        client = Client(addr, key, timeout_s=CONNECT_TIMEOUT_S, name="hvdlite.run caller")
        try:
            _, blob = client.request({"op": "function"}, timeout_s=TRANSFER_TIMEOUT_S)
            return client, blob
        except (OSError, HvdliteError) as exc:
            client.close()
            errors.append(f"{addr[0]}:{addr[1]}: {exc}")
    raise ConnectionError("cannot reach the caller of hvdlite.run: " + "; ".join(errors))


def _report_failure(client: Client, rank: int, text: str) -> int:
    sys.stderr.write(text)
    sys.stderr.flush()
    client.request({"op": "failure", "rank": rank, "traceback": text}, timeout_s=TRANSFER_TIMEOUT_S)
    return 1


def main() -> int:
    """Fetch, run, report; returns the exit code."""
    environ = dict(os.environ)
    # the function service's key is ours alone: the user's function and what it starts
    # (data-loader workers, shell commands) do not inherit it
    os.environ.pop(cfg.RUN_FUNC_KEY, None)
    rank = this_rank(environ)
    try:
        client, blob = _connect(environ, bytes.fromhex(environ[cfg.RUN_FUNC_KEY]))
    except ConnectionError as exc:
        sys.stderr.write(f"{MODULE}: rank {rank}: {exc}\n")
        return EXIT_NO_SERVICE
    try:
        try:
            fn, args, kwargs = loads(blob)
            result = fn(*args, **kwargs)
        except (Exception, SystemExit):  # the user's error, reported to the caller
            return _report_failure(client, rank, traceback.format_exc())
        try:
            payload = dumps(result)
        except Exception:  # pickling errors come in many types
            return _report_failure(
                client, rank, "the function's result cannot be pickled:\n" + traceback.format_exc()
            )
        client.request({"op": "result", "rank": rank}, payload, timeout_s=TRANSFER_TIMEOUT_S)
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
