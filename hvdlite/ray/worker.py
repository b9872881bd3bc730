"""The Ray actor that hosts one rank: where it runs, its environment, the user's code."""

import os
import socket
import traceback
from typing import Any, Callable, Dict, Optional

from hvdlite.common import config as cfg
from hvdlite.runner.tasks.nics import discover_nics


class RankWorker:
    """One rank of a :class:`hvdlite.ray.RayExecutor` job (made a Ray actor by the executor).

    The job's key arrives through :meth:`setup`'s arguments (Ray's object transfer), never
    on a command line; it goes into this process's environment, where ``hvd.init()`` reads
    it (and takes it out again).
    """

    def __init__(self):
        self.executable = None
        self._env: Dict[str, str] = {}

    def where(self) -> Dict[str, Any]:
        """This actor's node (Ray's id and address), host name and pid."""
        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
                "pid": os.getpid()}

    def setup(self, env: Dict[str, str], node_ip: str, executable_cls: Optional[type] = None,
              executable_args=(), executable_kwargs: Optional[dict] = None) -> None:
        """Set the rank's environment (Gloo on the interface holding ``node_ip``), then build
        the user's executable object (if any)."""
        env = dict(env)
        iface = _iface_of(node_ip)
        if iface:
            env.setdefault(cfg.GLOO_IFACE, iface)
        self._env = env
        os.environ.update(env)
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or ()),
                                             **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` in this rank; the environment is set again first (``init()``
        takes the job key out of it)."""
        os.environ.update(self._env)
        return _call(fn, self.executable)

    def run(self, fn: Callable, args=(), kwargs: Optional[dict] = None) -> Any:
        os.environ.update(self._env)
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
