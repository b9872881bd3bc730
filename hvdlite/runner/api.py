"""``hvdlite.run``: run a Python function on every rank and return each rank's result.

Horovod's ``horovod.run``: the function runs through the same launcher as
``hvdlite-run`` (local ranks, SSH hosts, ``use_mpi``), each rank as
``python -m hvdlite.runner.tasks.function_rank``.  The caller serves the pickled
``(function, args, kwargs)`` and collects results through a
:class:`~hvdlite.common.net.service.Service` with a fresh key: every frame is
HMAC-verified before it is decoded, so only the job's ranks can hand the caller
bytes to unpickle.  The key reaches the ranks like the job key does (their
environment, a task's stdin over SSH, or by name through mpiexec), never on a
command line.
"""

import logging
import socket
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import psutil

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteError, HvdliteLaunchError
from hvdlite.common.net.framing import new_key
from hvdlite.common.net.service import Header, Service, ServiceError
from hvdlite.runner.agent.job import run_job
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.cli import launch
from hvdlite.runner.cli.options import LaunchOptions
from hvdlite.runner.hosts import is_local
from hvdlite.runner.tasks.function_rank import MODULE as TASK_MODULE
from hvdlite.runner.tasks.function_rank import dumps, loads

log = logging.getLogger(__name__)


class RunFunctionError(HvdliteError, RuntimeError):
    """The function raised on a rank; ``rank`` and ``remote_traceback`` say where and what."""

    def __init__(self, rank: int, remote_traceback: str):
        super().__init__(f"hvdlite.run: the function raised on rank {rank}:\n"
                         f"{remote_traceback.rstrip()}")
        self.rank = rank
        self.remote_traceback = remote_traceback


class _FunctionService(Service):
    """Hands out the function and collects each rank's result or traceback."""

    def __init__(self, key: bytes, payload: bytes, np: int, bind_addr: str):
        self._payload = payload
        self._np = np
        self._lock = threading.Lock()
        self.results: Dict[int, bytes] = {}
        #: (rank, traceback text) in the order the ranks reported them
        self.failures: List[Tuple[int, str]] = []
        super().__init__("hvdlite.run function service", key, bind_addr=bind_addr,
                         expected_peers=np)

    def handle(self, header: Header, blob: bytes, client) -> Tuple[Header, bytes]:
        op = header.get("op")
        if op == "function":
            return {}, self._payload
        rank = header.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self._np:
            raise ServiceError(f"rank {rank!r} is outside 0..{self._np - 1}")
        with self._lock:
            if op == "result":
                self.results[rank] = blob
            elif op == "failure":
                self.failures.append((rank, str(header.get("traceback", ""))))
            else:
                raise ServiceError(f"unknown request {op!r}")
        return {}, b""


def run(func: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None, np: int = 1,
        min_np: Optional[int] = None, max_np: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None,
        cooldown_range: Optional[Sequence[float]] = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None,
        start_timeout: Optional[float] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, disable_cache: Optional[bool] = None,
        output_filename: Optional[str] = None, verbose: Optional[bool] = None,
        use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None, network_interface: Optional[str] = None,
        executable: Optional[str] = None, *,
        network_interfaces: Optional[Union[str, Sequence[str]]] = None,
        use_jsrun: Optional[bool] = None, env: Optional[Mapping[str, str]] = None) -> List[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` ranks; return their results in rank order.

    The arguments are ``horovod.run``'s and mean what the ``hvdlite-run`` flags of the
    same names mean (``hosts`` is ``-H``, ``network_interface(s)`` a comma-separated string
    or a list, ``executable`` the Python that runs each rank, default ``sys.executable``).
    ``env`` (hvdlite only) adds variables for every rank, like ``-x NAME=VALUE``.  The
    function and its arguments are pickled with cloudpickle when it is installed, else
    with pickle; it may call ``hvdlite.torch.init()`` like any training script.

    Raises:
        HvdliteConfigError: a bad argument, an elastic argument (hvdlite.run runs static
            jobs; use hvdlite-run with ``hvd.elastic.run``), or a function or argument
            that cannot be pickled.
        RunFunctionError: the function raised on a rank (names the first rank that
            reported, with its traceback text).
        HvdliteLaunchError: a host or rank failed otherwise, or the job ended before every
            rank returned.
    """
    _refuse(min_np=min_np, max_np=max_np, slots=slots, reset_limit=reset_limit,
            cooldown_range=cooldown_range, hosts=hosts, hostfile=hostfile,
            use_gloo=use_gloo, use_mpi=use_mpi, use_jsrun=use_jsrun)
    try:
        payload = dumps((func, tuple(args), dict(kwargs or {})))
    except Exception as exc:                 # pickling errors come in many types
        raise HvdliteConfigError(
            f"hvdlite.run: the function or its arguments cannot be pickled: {exc}") from None
    nics = network_interfaces if network_interfaces is not None else network_interface
    if nics is not None and not isinstance(nics, str):
        nics = ",".join(nics)
    options = _options(np=np, hosts=hosts, hostfile=hostfile, start_timeout=start_timeout,
                       ssh_port=ssh_port, ssh_identity_file=ssh_identity_file,
                       disable_cache=disable_cache, output_filename=output_filename,
                       verbose=verbose, use_gloo=use_gloo, use_mpi=use_mpi,
                       use_jsrun=use_jsrun, mpi_args=mpi_args, nics=nics, env=env,
                       command=[executable or sys.executable, "-m", TASK_MODULE])
    spec = launch.spec_from_args(options)
    spec.name = "hvdlite.run"
    return _run_job(spec, payload)


def _run_job(spec: JobSpec, payload: bytes) -> List[Any]:
    """Serve ``payload`` to the job's ranks, run the job, and collect the results (see
    :func:`run` for what it raises)."""
    local = all(is_local(h.hostname) for h in spec.hosts)
    key = new_key()
    service = _FunctionService(key, payload, spec.np,
                               bind_addr="127.0.0.1" if local else "0.0.0.0")
    try:
        spec.secret_env.update({
            cfg.RUN_FUNC_KEY: key.hex(),
            cfg.RUN_FUNC_PORT: str(service.address[1]),
            cfg.RUN_FUNC_ADDRS: ",".join(_addresses(local, spec.network_interfaces)),
        })
        code = run_job(spec).exit_code
    finally:
        service.shutdown()
    return _collect(service, spec.np, code)


def _refuse(min_np, max_np, slots, reset_limit, cooldown_range, hosts, hostfile,
            use_gloo, use_mpi, use_jsrun) -> None:
    """Refuse what hvdlite.run does not take: elastic arguments, both host arguments,
    more than one controller.

    Raises:
        HvdliteConfigError: names the arguments.
    """
    elastic = {"min_np": min_np, "max_np": max_np, "slots": slots,
               "reset_limit": reset_limit, "cooldown_range": cooldown_range}
    given = [name for name, value in elastic.items() if value is not None]
    if given:
        raise HvdliteConfigError(
            f"hvdlite.run runs static jobs only ({', '.join(given)} given); run an elastic "
            f"job with hvdlite-run and hvd.elastic.run")
    if hosts is not None and hostfile is not None:
        raise HvdliteConfigError("hvdlite.run: give hosts or hostfile, not both")
    if sum(bool(x) for x in (use_gloo, use_mpi, use_jsrun)) > 1:
        raise HvdliteConfigError("hvdlite.run: use_gloo, use_mpi and use_jsrun exclude "
                                 "each other")


def _options(np: int, hosts, hostfile, start_timeout, ssh_port, ssh_identity_file,
             disable_cache, output_filename, verbose, use_gloo, use_mpi, use_jsrun, mpi_args,
             nics, env, command: List[str]) -> LaunchOptions:
    """``run``'s arguments as hvdlite-run's options (every other flag at its default), so
    that every value goes through the checks a command line gets -- without making or
    parsing a command line."""
    if isinstance(np, bool) or not isinstance(np, int):
        raise HvdliteConfigError(f"hvdlite.run: np={np!r} is not a number of processes")
    return LaunchOptions(
        np=np, hosts=hosts, hostfile=hostfile, ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file, output_filename=output_filename,
        network_interfaces=nics, mpi_args=mpi_args, disable_cache=bool(disable_cache),
        verbose=bool(verbose), gloo=bool(use_gloo), mpi=bool(use_mpi), jsrun=bool(use_jsrun),
        env=[f"{name}={value}" for name, value in (env or {}).items()], command=command,
        tunable_values={} if start_timeout is None else {"start_timeout": start_timeout})


def _addresses(local: bool, nics: Optional[List[str]]) -> List[str]:
    """This host's IPv4 addresses the ranks may use to reach the function service:
    loopback for a local job, else every interface's (``nics`` only, if given)."""
    if local:
        return ["127.0.0.1"]
    found, loop = [], []
    for iface, addrs in psutil.net_if_addrs().items():
        if nics and iface not in nics:
            continue
        for a in addrs:
            if a.family == socket.AF_INET:
                (loop if a.address.startswith("127.") else found).append(a.address)
    return found + loop


def _collect(service: _FunctionService, np: int, code: int) -> List[Any]:
    """The results in rank order, or the error that explains why there are none.

    Raises:
        RunFunctionError: a rank reported that the function raised.
        HvdliteLaunchError: the job failed otherwise or a result cannot be unpickled.
    """
    if service.failures:
        rank, text = service.failures[0]
        raise RunFunctionError(rank, text)
    missing = [r for r in range(np) if r not in service.results]
    if code != 0 or missing:
        what = (f"before rank(s) {missing} returned a result" if missing
                else "after every rank returned")
        raise HvdliteLaunchError(
            f"hvdlite.run: the job exited with code {code} {what}; see the ranks' output above")
    results = []
    for rank in range(np):
        try:
            results.append(loads(service.results[rank]))
        except Exception as exc:             # unpickling errors come in many types
            raise HvdliteLaunchError(
                f"hvdlite.run: rank {rank}'s result cannot be unpickled here: "
                f"{type(exc).__name__}: {exc}") from None
    return results
