"""The Ray actor that hosts one rank: where it runs, its environment, the user's code."""

import os
import socket
import traceback
from typing import Any, Callable, Dict, Optional

from hvdlite.common import config as cfg
from hvdlite.runner.tasks.nics import discover_nics


class RankWorker:
    """One rank of a :class:`hvdlite.ray.RayExecutor` job (made a Ray actor by the executor).

    Each job's environment -- its key included -- arrives as an argument of the call
    that runs in it (Ray's object transfer), never on a command line; it goes into this
    process's environment, where ``hvd.init()`` reads it (and takes the key out again).
    """

    def __init__(self):
        self.executable = None
        self._env: Dict[str, str] = {}
        self._iface = ""
        self._executable_cls: Optional[type] = None
        self._executable_args: tuple = ()
        self._executable_kwargs: dict = {}

    def where(self) -> Dict[str, Any]:
        """This actor's node (Ray's id and address), host name and pid."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    def setup(
        self,
        node_ip: str,
        executable_cls: Optional[type] = None,
        executable_args=(),
        executable_kwargs: Optional[dict] = None,
    ) -> None:
        """Remember the Gloo interface (the one holding ``node_ip``) and the user's
        executable class, built at the first call, inside its job's environment."""
        self._iface = _iface_of(node_ip)
        self._executable_cls = executable_cls
        self._executable_args = tuple(executable_args or ())
        self._executable_kwargs = dict(executable_kwargs or {})

    def _enter(self, env: Optional[Dict[str, str]]) -> None:
        """Take on a job's environment (``None``: the last job's; ``init()`` takes the key
        out of it each time), then build the executable if it is not built yet."""
        if env is not None:
            self._env = dict(env)
            if self._iface:
                self._env.setdefault(cfg.GLOO_IFACE, self._iface)
        os.environ.update(self._env)
        if self.executable is None and self._executable_cls is not None:
            self.executable = self._executable_cls(
                *self._executable_args, **self._executable_kwargs
            )

    def execute(self, fn: Callable[[Any], Any], env: Optional[Dict[str, str]] = None) -> Any:
        """``fn(executable)`` in this rank, in the job environment ``env``."""
        _call(self._enter, env)
        return _call(fn, self.executable)

    def run(
        self,
        fn: Callable,
        args=(),
        kwargs: Optional[dict] = None,
        env: Optional[Dict[str, str]] = None,
    ) -> Any:
        """``fn(*args, **kwargs)`` in this rank, in the job environment ``env``."""
        _call(self._enter, env)
        return _call(fn, *(args or ()), **(kwargs or {}))

    def ping(self) -> int:
        return os.getpid()


class RankFailed(Exception):
    """What a rank's exception becomes on its way to the driver: the type, message and
    traceback as text (the exception itself may not unpickle on the driver)."""


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise RankFailed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from None


def _iface_of(ip: str) -> str:
    """The network interface holding ``ip`` on this node, or "" (Gloo then picks)."""
    if not ip:
        return ""
    for name, addrs in discover_nics().items():
        if ip in addrs:
            return name
    return ""
