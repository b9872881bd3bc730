"""The rendezvous store of a job that torchrun (or a PyTorchJob, or any launcher setting
torchrun's variables) started: torch's own ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``.

Under ``hvdlite-run`` a rank meets its peers at the launcher's authenticated store and
learns its place from the launcher's rendezvous round.  Under torchrun there is no such
launcher: the place comes from torchrun's variables (read by ``Config.from_env``) and the
keys go to torch's store, which torchrun's agent serves (``TORCHELASTIC_USE_AGENT_STORE``)
or, without an agent (a PyTorchJob's plain ``python train.py``), rank 0 serves, as torch's
``env://`` does.  :class:`TorchStoreClient` answers the calls the Gloo backend makes of
``kv.KVClient``, so negotiation, fusion, shared memory and the diagnostics inside a rank
are the same as under hvdlite-run.  torch's store has no authentication (SECURITY.md).
"""

import datetime
import os
import secrets
from typing import List, Optional

from hvdlite.common.config import START_TIMEOUT, Config, env_names
from hvdlite.common.exceptions import HvdliteTimeoutError
from hvdlite.common.net.kv import Placement

#: where this job's keys live in torch's store (beside torch's own, which never use it)
KEY_SPACE = "hvdlite/"
#: the key rank 0 posts the job's HMAC key under (for broadcast_object and friends)
JOB_KEY = "job-key"


def _connect(config: Config):
    """torch's store, as a client (or, rank 0 without torchrun's agent, as its server)."""
    import torch.distributed as dist  # only Gloo jobs come here: they have torch

    host, port = config.torch_store_addr.rsplit(":", 1)
    # torchrun's agent serves the store; without one (a pod per rank), rank 0 does
    agent = os.environ.get(env_names.TORCH_USE_AGENT_STORE, "").lower() in ("1", "true")
    serve = config.rank == 0 and not agent
    timeout = datetime.timedelta(seconds=config.start_timeout_s)
    try:
        store = dist.TCPStore(
            host,
            int(port),
            config.size if serve else None,
            is_master=serve,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=serve,
        )
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or DistNetworkError
        raise HvdliteTimeoutError(
            f"rank {config.rank} ({config.hostname}): cannot reach torch's store at "
            f"{config.torch_store_addr} (MASTER_ADDR:MASTER_PORT) within "
            f"{config.start_timeout_s:g}s ({START_TIMEOUT}): "
            f"{exc}"
        ) from None
    return store


class TorchStoreClient:
    """``kv.KVClient``'s calls over torch's store; keys are namespaced by ``prefix``.

    One client per use (the job's group, a process set, a host's cross group), as with
    the launcher's store; they share one connection per process."""

    _shared = None  # the torch.distributed.Store, once made
    _shared_for: Optional[str] = None

    def __init__(self, config: Config):
        self._config = config
        self.timeout_s = config.start_timeout_s
        self.prefix = ""
        #: no launcher publishes rounds here: a wait is never superseded
        self.round: Optional[int] = None
        self.superseded_by: Optional[int] = None
        cls = type(self)
        if cls._shared is None or cls._shared_for != config.torch_store_addr:
            cls._shared = _connect(config)
            cls._shared_for = config.torch_store_addr
        self._store = cls._shared

    def _k(self, key: str) -> str:
        return KEY_SPACE + self.prefix + key

    def _timed(self, what: str, call, timeout_s: float):
        self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - torch's DistStoreError / RuntimeError
            raise HvdliteTimeoutError(
                f"rendezvous (torch's store at {self._config.torch_store_addr}): {what}: {exc}"
            ) from None

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._k(key), bytes(value))

    def get(self, key: str) -> bytes:
        return self._timed(
            f"waiting for key {key!r}", lambda: self._store.get(self._k(key)), self.timeout_s
        )

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(self._k(key), int(amount)))

    def check(self, keys: List[str]) -> bool:
        return bool(self._store.check([self._k(k) for k in keys]))

    def wait(self, keys: List[str], timeout_s: Optional[float] = None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        names = [self._k(k) for k in keys]
        self._timed(
            f"waiting for keys {list(keys)[:5]}",
            lambda: self._store.wait(names, datetime.timedelta(seconds=t)),
            t,
        )

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store.compare_set(self._k(key), bytes(expected), bytes(desired))

    def delete(self, key: str) -> bool:
        return bool(self._store.delete_key(self._k(key)))

    def num_keys(self) -> int:
        return int(self._store.num_keys())

    def join_round(self, after: int, hostname: str, local_rank: int, timeout_s: float) -> Placement:
        """The place torchrun gave this process, in the round after ``after`` (every
        rank inits and shuts down in the same order, so their rounds agree)."""
        c = self._config
        return Placement(
            after + 1, c.rank, c.size, c.local_rank, c.local_size, c.cross_rank, c.cross_size
        )

    def newest_round(self) -> int:
        return -1

    def await_round(self, after: int, timeout_s: float) -> int:
        return after

    def close(self) -> None:
        """The connection is shared by the process's clients and lives as long as it."""


def job_key(config: Config) -> bytes:
    """The key that signs pickles between this job's ranks: the first rank to ask posts a
    random one in torch's store and every rank reads that (so it is as secret as the store
    is: SECURITY.md).  The same key for every init of the job's processes."""
    client = TorchStoreClient(config)
    client.prefix = config.job_id + "/"
    mine = secrets.token_hex(32).encode()
    return bytes.fromhex(client.compare_set(JOB_KEY, b"", mine).decode())
