"""torch's own store for the ranks of a job, as torchrun's agent serves it.

A ``torch.distributed`` program (plain DDP or FSDP, Lightning's ``ddp``, a Hugging Face
``Trainer`` or ``accelerate`` script) calls ``init_process_group()``, which reads
torchrun's variables and meets its peers at ``MASTER_ADDR:MASTER_PORT``.  The launcher
sets those variables (``hvdlite.runner.processes.workers.torch_place`` and the agent's
job environment) and serves the store there, in a child process
(``python -m hvdlite.common.backend.torch_store``: the launcher imports no framework), with every
rank a client of it (``TORCHELASTIC_USE_AGENT_STORE``) as under torchrun.  The child is
started when the job starts, so that importing torch overlaps the ranks' start; the
port is chosen here, free when chosen; the child dies with the launcher (its lifeline
is its stdin and the parent-death signal).

torch's store has no authentication and listens on every interface of the launcher's
host: SECURITY.md says what that does and does not expose; ``--no-torch-env`` turns it
off.
"""

import importlib.util
import logging
import socket
import subprocess
import sys
import threading
from typing import Optional

from hvdlite.common.exceptions import HvdliteLaunchError
from hvdlite.runner.processes import lifeline

log = logging.getLogger(__name__)

#: the module the child runs
MODULE = "hvdlite.common.backend.torch_store"
#: bound on the child answering that it listens (it imports torch first)
START_S = 60.0
#: bound on the child ending once its stdin is closed
STOP_S = 5.0


def torch_importable() -> bool:
    """Can this launcher's Python serve torch's store (found, not imported)?"""
    return importlib.util.find_spec("torch") is not None


def free_port() -> int:
    """A TCP port free on every interface of this host now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class TorchStore:
    """The child process serving torch's store on :attr:`port`; :meth:`wait` before the
    first rank needs it, :meth:`stop` at the end of the job."""

    def __init__(self) -> None:
        self.port = free_port()
        self._proc = lifeline.popen([sys.executable, "-m", MODULE, "127.0.0.1", str(self.port)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    start_new_session=True)
        self._ready: Optional[bool] = None
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Until the child listens.

        Raises:
            HvdliteLaunchError: it ended, or did not listen within :data:`START_S`.
        """
        with self._lock:
            if self._ready is None:
                timer = threading.Timer(START_S, self._proc.kill)
                timer.start()
                try:
                    line = self._proc.stdout.readline()
                finally:
                    timer.cancel()
                self._ready = line.startswith(b"listening")
            if not self._ready:
                raise HvdliteLaunchError(
                    f"torch's store for the ranks (torchrun's MASTER_PORT) could not listen on "
                    f"port {self.port} of this host (see the line above); run the job with "
                    f"--no-torch-env if your program does not call init_process_group()")

    def stop(self) -> None:
        """End the child (closing its stdin; killed after :data:`STOP_S`)."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
