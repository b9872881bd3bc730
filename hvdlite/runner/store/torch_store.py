"""torch's own store for the ranks of a job, as torchrun's agent serves it.

A ``torch.distributed`` program (plain DDP or FSDP, Lightning's ``ddp``, a Hugging Face
``Trainer`` or ``accelerate`` script) calls ``init_process_group()``, which reads
torchrun's variables and meets its peers at ``MASTER_ADDR:MASTER_PORT``.  The launcher
sets those variables (the agent's job environment and
``hvdlite.runner.processes.workers.torch_place``) with every rank a client
(``TORCHELASTIC_USE_AGENT_STORE``) of one store that lives as long as the job, as under
torchrun.  :class:`TorchStore` listens on the port at once, without torch (the launcher
imports no framework); the first connection starts the server, a child process
(``python -m hvdlite.common.backend.torch_store``) that takes over the listening socket,
so a job whose program never calls ``init_process_group()`` costs no torch import.  The
child dies with the launcher (its stdin is its lifeline, and the parent-death signal).

torch's store has no authentication: a job whose hosts are all this one keeps it on
loopback; otherwise it listens on every interface (SECURITY.md).
"""

import logging
import select
import socket
import subprocess
import sys
import threading
from typing import Optional

from hvdlite.runner.processes import lifeline

log = logging.getLogger(__name__)

#: the module the server child runs
MODULE = "hvdlite.common.backend.torch_store"
#: bound on the child saying it serves (it imports torch first)
START_S = 60.0
#: bound on the child ending once its stdin is closed
STOP_S = 5.0
#: how often the waiting thread checks whether the job ended (stop() also wakes it at once)
WAIT_SLICE_S = 0.5


class TorchStore:
    """The port of torch's store for one job; the server starts at the first connection."""

    def __init__(self, loopback: bool):
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1" if loopback else "", 0))
        self._sock.listen(1024)
        self.port: int = self._sock.getsockname()[1]
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # stop() writes here so the waiting thread's select returns at once: a launch's
        # end then costs no wait slice (closing the listening socket does not wake select)
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(
            target=self._serve_when_asked, daemon=True, name="hvdlite-torch-store"
        )
        self._thread.start()

    def _serve_when_asked(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._sock, self._wake_r], [], [], WAIT_SLICE_S)
            except (OSError, ValueError):  # closed by stop()
                return
            if self._sock in ready and not self._closed.is_set():
                self._start_server()
                return

    def _start_server(self) -> None:
        """The server child, on the listening socket (the connection waits in its queue)."""
        with self._lock:
            if self._closed.is_set():
                return
            fd = self._sock.fileno()
            try:
                self._proc = lifeline.popen(
                    [sys.executable, "-m", MODULE, str(self.port), str(fd)],
                    pass_fds=(fd,),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                log.warning(
                    "cannot start torch's store for the ranks (MASTER_PORT %d): %s", self.port, exc
                )
                return
            proc = self._proc
        timer = threading.Timer(START_S, proc.kill)
        timer.start()
        try:
            line = proc.stdout.readline()  # EOF too when stop() ends the child
        finally:
            timer.cancel()
        if self._closed.is_set():
            return
        if not line.startswith(b"listening"):
            log.warning(
                "torch's store for the ranks (MASTER_PORT %d) did not start (see the "
                "line above): the ranks' init_process_group() will time out; rerun "
                "with --no-torch-env if your program sets MASTER_ADDR itself",
                self.port,
            )

    def stop(self) -> None:
        """End the server (closing its stdin; killed after :data:`STOP_S`), or stop
        listening if it never started."""
        with self._lock:
            self._closed.set()
            proc = self._proc
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._thread.join(STOP_S)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()
