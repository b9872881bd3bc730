"""Starting a task process on a host: paramiko for remote hosts (imported only then), a
subprocess locally.

With ``--launcher-agent CMD`` remote hosts are reached through ``CMD HOST COMMAND``
instead of SSH (as Open MPI's ``plm_rsh_agent``): e.g. a wrapper around
``kubectl exec -i POD -- sh -c COMMAND`` where pods have no sshd.  The agent must
pass its stdin on to the command (``kubectl exec -i`` does), since the payload and
the lifeline travel there.

The task's start-up payload (which carries the job key) is written to the
task's stdin, never put on a command line; stdin then stays open as the
task's lifeline: when it closes (we are done, or the launcher died and the SSH
connection dropped) the task ends its workers and exits.
"""

import abc
import dataclasses
import getpass
import json
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import psutil

from hvdlite.common.exceptions import (
    HvdliteConfigError,
    HvdliteError,
    HvdliteLaunchError,
    HvdliteTimeoutError,
)
from hvdlite.runner.processes import lifeline
from hvdlite.runner.hosts import HostSlots, resolve
from hvdlite.runner.hosts.slots import host_name_problem
from hvdlite.runner.processes.workers import kill_tree

log = logging.getLogger(__name__)


def _paramiko():
    """paramiko, imported when a task is first started over SSH (later calls find it in
    ``sys.modules``): it costs ~0.1 s of CPU, which a launch on this host alone need not pay."""
    import paramiko

    # paramiko logs every failure it raises to us as a traceback from its transport
    # thread; we report each in one line (host, port, what was expected) instead
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    return paramiko


TASK_MODULE = "hvdlite.runner.tasks.task_service"
_RANK_LINE = re.compile(rb"^\[(\d+)\]<(stdout|stderr)>:(.*)$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class SSHOptions:
    """How to reach remote hosts (``-p``, ``-i``, known-hosts policy)."""

    port: int = 22
    identity_file: Optional[str] = None
    known_hosts_file: Optional[str] = None
    #: reject hosts whose key is not in the known-hosts files (else warn and accept).
    strict_host_key_checking: bool = False
    python: str = sys.executable
    #: ``--launcher-agent``: a command that runs ``COMMAND`` on ``HOST`` when called as
    #: ``CMD HOST COMMAND`` (None: SSH)
    launcher_agent: Optional[str] = None


class TaskProcess(abc.ABC):
    """A running task; its stdout carries rank lines ``[rank]<stream>:...``."""

    hostname: str
    #: what a read of the task's output raises when the task or its connection is gone
    stream_errors: tuple = (OSError, ValueError, EOFError)

    def pump_output(
        self,
        on_rank_line: Callable[[int, str, bytes], None],
        on_other_line: Callable[[bytes], None],
    ) -> None:
        """Start threads that route each stdout line to a rank and each stderr line out."""

        def on_stdout(line: bytes):
            m = _RANK_LINE.match(line)
            if m:
                on_rank_line(int(m.group(1)), m.group(2).decode(), m.group(3))
            else:
                on_other_line(line)

        self._pumps = [
            _pump(self._stdout(), on_stdout, f"task-{self.hostname}-stdout", self.stream_errors),
            _pump(
                self._stderr(), on_other_line, f"task-{self.hostname}-stderr", self.stream_errors
            ),
        ]

    def join_output(self, timeout_s: float) -> None:
        for p in getattr(self, "_pumps", []):
            p.join(timeout_s)

    @abc.abstractmethod
    def _stdout(self): ...

    @abc.abstractmethod
    def _stderr(self): ...

    @abc.abstractmethod
    def close_stdin(self) -> None:
        """Close the lifeline; the task then ends its workers and exits."""

    @abc.abstractmethod
    def poll(self) -> Optional[int]:
        """The task's exit code, or None while it runs."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> Optional[int]:
        """Wait up to ``timeout_s`` for the task to exit; its code or None."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Cut the task off (local: kill its process tree; remote: drop the connection)."""


def _pump(stream, on_line, name, errors) -> threading.Thread:
    def run():
        try:
            while True:
                line = stream.readline()
                if not line:
                    break
                if isinstance(line, str):
                    line = line.encode()
                on_line(line)
        except errors:
            pass

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


class LocalTask(TaskProcess):
    """The task as a child process: this host's, or (``argv`` given) a launcher agent
    that runs it on another host."""

    def __init__(self, host: HostSlots, payload: bytes, python: str, argv: Optional[list] = None):
        self.hostname = host.hostname
        # SIGTERM if we die: its workers are tied to the task's life in turn
        self._proc = lifeline.popen(
            argv or [python, "-m", TASK_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            death_signal=signal.SIGTERM,
        )
        self._proc.stdin.write(payload)
        self._proc.stdin.flush()

    def _stdout(self):
        return self._proc.stdout

    def _stderr(self):
        return self._proc.stderr

    def close_stdin(self):
        try:
            self._proc.stdin.close()
        except OSError:
            pass

    def poll(self):
        return self._proc.poll()

    def wait(self, timeout_s):
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        try:
            kill_tree(psutil.Process(self._proc.pid), grace_s=2.0)
        except psutil.NoSuchProcess:
            pass
        self.wait(2.0)


class SSHTask(TaskProcess):
    def __init__(self, host: HostSlots, payload: bytes, opts: SSHOptions, timeout_s: float):
        paramiko = _paramiko()
        # a channel's reads fail with paramiko's own error besides the usual ones
        self.stream_errors = TaskProcess.stream_errors + (paramiko.SSHException,)
        self.hostname = host.hostname
        target = f"{host.ssh_target}:{opts.port}"
        client = ssh_connect(host, opts, timeout_s)
        self._client = client
        try:
            chan = client.get_transport().open_session(timeout=timeout_s)
            chan.exec_command(remote_command(opts.python))
        except (paramiko.SSHException, OSError) as exc:
            client.close()
            raise HvdliteLaunchError(f"SSH to {target}: cannot start the task: {exc}") from None
        self._chan = chan
        # held for the task's life: closing (or collecting) it shuts the lifeline
        self._stdin = chan.makefile_stdin("wb")
        self._out = chan.makefile("rb")
        self._err = chan.makefile_stderr("rb")
        self._stdin.write(payload)
        self._stdin.flush()
        log.info("SSH to %s: task started", target)

    def _stdout(self):
        return self._out

    def _stderr(self):
        return self._err

    def close_stdin(self):
        try:
            self._chan.shutdown_write()
        except (OSError, EOFError, _paramiko().SSHException):
            pass

    def poll(self):
        if self._chan.exit_status_ready():
            return self._chan.recv_exit_status()
        if self._chan.closed or not self._client.get_transport().is_active():
            return -1
        return None

    def wait(self, timeout_s):
        if self._chan.status_event.wait(timeout_s):
            return self._chan.recv_exit_status()
        return self.poll()

    def kill(self):
        self._client.close()


def ssh_connect(host: HostSlots, opts: SSHOptions, timeout_s: float):
    """A paramiko client logged in to ``host`` with a key (never a password prompt).

    Raises:
        HvdliteConfigError: the host name does not resolve.
        HvdliteError: the connection or the login failed (one line: what, and what to
            check).
    """
    paramiko = _paramiko()
    target = f"{host.ssh_target}:{opts.port}"
    resolve(host.hostname)  # a clear "unknown host" before paramiko's own error
    client = _ssh_client(opts)
    user = host.user or getpass.getuser()
    sock = _open_ssh_socket(host.hostname, opts.port, timeout_s)
    try:
        client.connect(
            host.hostname,
            port=opts.port,
            username=user,
            sock=sock,
            key_filename=opts.identity_file,
            timeout=timeout_s,
            banner_timeout=timeout_s,
            auth_timeout=timeout_s,
            allow_agent=opts.identity_file is None,
            look_for_keys=opts.identity_file is None,
        )
    except (paramiko.SSHException, OSError) as exc:
        client.close()
        raise _connect_error(exc, target, user, opts, timeout_s) from None
    return client


def remote_command(python: str) -> str:
    """The shell command that starts a task on another host (in the launcher's directory
    when the host has it)."""
    return f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec {shlex.quote(python)} -m {TASK_MODULE}"


def agent_task(host: HostSlots, payload: bytes, opts: SSHOptions) -> LocalTask:
    """The task started on ``host`` through ``--launcher-agent``.

    Raises:
        HvdliteConfigError: the agent command is empty or cannot be run.
    """
    argv = shlex.split(opts.launcher_agent or "")
    if not argv:
        raise HvdliteConfigError("--launcher-agent: empty command")
    # the agent's contract is 'CMD HOST COMMAND' (documented, and what kubexec-style
    # wrappers read as $1 $2), so no '--' can go before HOST: a HOST that an agent could
    # take for an option is refused here, whichever host source it came from
    if host.ssh_target.startswith("-") or host_name_problem(host.hostname):
        raise HvdliteConfigError(
            f"--launcher-agent: host {host.ssh_target!r} is not passed to the agent: "
            f"{host_name_problem(host.hostname) or 'it starts with -'}"
        )
    try:
        task = LocalTask(
            host, payload, opts.python, argv + [host.ssh_target, remote_command(opts.python)]
        )
    except OSError as exc:
        raise HvdliteConfigError(
            f"--launcher-agent {opts.launcher_agent!r}: cannot run it: {exc.strerror or exc}"
        ) from None
    log.info("launcher agent %s: task on %s started", argv[0], host.hostname)
    return task


def _open_ssh_socket(hostname: str, port: int, timeout_s: float) -> socket.socket:
    """A TCP connection to ``hostname:port`` on which an SSH server has started talking.

    Waits (``MSG_PEEK``, nothing consumed: paramiko reads the banner itself) for the
    server's first bytes, so that a port that accepts connections but is not an SSH
    server -- or a server too busy to answer -- is reported in one line, not as
    paramiko's tracebacks and its misleading "No existing session".

    Raises:
        HvdliteTimeoutError: no connection, or no banner, within ``timeout_s``.
        HvdliteLaunchError: the connection is refused or closed before a banner.
    """
    target = f"{hostname}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((hostname, port), timeout=timeout_s)
    except socket.timeout:
        raise HvdliteTimeoutError(
            f"SSH to {target}: no answer within {timeout_s:.0f}s (raise --start-timeout, or "
            f"check the host and -p/--ssh-port)"
        ) from None
    except OSError as exc:
        reason = (
            "connection refused"
            if isinstance(exc, ConnectionRefusedError)
            else (exc.strerror or str(exc))
        )
        raise HvdliteLaunchError(
            f"SSH to {target}: cannot connect: {reason} (is sshd running there? check "
            f"-p/--ssh-port)"
        ) from None
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        first = sock.recv(4, socket.MSG_PEEK)
    except socket.timeout:
        sock.close()
        raise HvdliteTimeoutError(
            f"SSH to {target}: the host accepted the TCP connection but sent no SSH banner "
            f"within {timeout_s:.0f}s (expected an SSH server on port {port}; check "
            f"-p/--ssh-port, or raise --start-timeout if the host is overloaded)"
        ) from None
    except OSError as exc:
        sock.close()
        raise HvdliteLaunchError(
            f"SSH to {target}: the connection failed before the SSH banner: {exc.strerror or exc}"
        ) from None
    if not first:
        sock.close()
        raise HvdliteLaunchError(
            f"SSH to {target}: the host closed the connection without an SSH banner (is "
            f"this port an SSH server? check -p/--ssh-port)"
        )
    sock.settimeout(timeout_s)
    return sock


def start_task(
    host: HostSlots, local: bool, payload: dict, opts: SSHOptions, timeout_s: float
) -> TaskProcess:
    """Start the task service process for ``host``.

    Raises:
        HvdliteConfigError: the host name does not resolve, or --ssh-known-hosts is unreadable.
        HvdliteLaunchError: the host refuses the connection or the login, or its key
            does not match; or the task cannot be started there.
        HvdliteTimeoutError: the host did not answer within ``timeout_s``.
    """
    data = (json.dumps(payload) + "\n").encode()
    if local:
        return LocalTask(host, data, opts.python)
    if opts.launcher_agent:
        return agent_task(host, data, opts)
    return SSHTask(host, data, opts, timeout_s)


def _ssh_client(opts: SSHOptions):
    """A client that knows the hosts of --ssh-known-hosts (else the user's file) and
    applies --ssh-strict-host-key-checking.

    Raises:
        HvdliteConfigError: --ssh-known-hosts cannot be read.
    """
    paramiko = _paramiko()
    client = paramiko.SSHClient()
    client.load_system_host_keys()
    if opts.known_hosts_file:
        try:
            client.load_host_keys(opts.known_hosts_file)
        except OSError as exc:
            raise HvdliteConfigError(
                f"--ssh-known-hosts {opts.known_hosts_file}: {exc.strerror}"
            ) from None
    else:
        default = os.path.expanduser("~/.ssh/known_hosts")
        if os.path.exists(default):
            try:
                client.load_host_keys(default)
            except (OSError, paramiko.SSHException):
                pass
    client.set_missing_host_key_policy(
        paramiko.RejectPolicy() if opts.strict_host_key_checking else _LogMissingKey()
    )
    return client


class _LogMissingKey:
    """paramiko's missing-host-key policy (its interface is this one method): accept the
    key and say so in the log, unlike its WarningPolicy's warning on stderr."""

    def missing_host_key(self, client, hostname, key):
        log.info(
            "SSH: host %s is not in known_hosts; accepting its %s key", hostname, key.get_name()
        )


def _connect_error(
    exc: BaseException, target: str, user: str, opts: SSHOptions, timeout_s: float
) -> HvdliteError:
    """The one-line error for a failed SSH connection: what failed, and what to check."""
    paramiko = _paramiko()
    if isinstance(exc, paramiko.AuthenticationException):
        hint = (
            f"the key {opts.identity_file} (-i/--ssh-identity-file)"
            if opts.identity_file
            else "your default keys (give one with -i)"
        )
        return HvdliteLaunchError(
            f"SSH to {target}: authentication as {user!r} failed with {hint}: {exc}"
        )
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return HvdliteTimeoutError(
            f"SSH to {target}: no answer within {timeout_s:.0f}s "
            f"(raise --start-timeout, or check the host and -p/--ssh-port)"
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return HvdliteLaunchError(f"SSH to {target}: host key mismatch: {exc}")
    if isinstance(exc, paramiko.SSHException):
        return HvdliteLaunchError(
            f"SSH to {target}: {exc} (strict host key checking: add the host to "
            f"--ssh-known-hosts, or drop --ssh-strict-host-key-checking)"
            if "not found in known_hosts" in str(exc)
            else f"SSH to {target}: {exc}"
        )
    reason = exc.strerror or str(exc)
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        reason = "connection refused"
    return HvdliteLaunchError(
        f"SSH to {target}: cannot connect: {reason} (is sshd running there? check -p/--ssh-port)"
    )
