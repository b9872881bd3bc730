"""The discovery-script host source: ``--host-discovery-script``, asked about once a second.

:class:`ScriptHosts` runs ``--host-discovery-script`` and parses what it prints,
one host per line::

    node1:4          # a host and its slots
    node2            # slots from --slots-per-host
    user@node3:2     # a login name for SSH, as on -H

Blank lines and ``#`` comments are ignored; an empty answer means "no hosts now".
A script that exits non-zero, runs past its timeout or prints a line that is not
``host[:slots]`` raises :class:`HostDiscoveryError`, which carries the script's
output.  The agent logs it and keeps the host set it had: one bad answer from a
flaky script must not end (or shrink) a running job.
"""

import logging
import os
import signal
import subprocess
import threading
import time
from typing import List, Optional

import psutil

from hvdlite.common import config as cfg
from hvdlite.runner.processes import lifeline
from hvdlite.runner.hosts.slots import HostSlots, host_name_problem
from hvdlite.runner.hosts.source import HostDiscoveryError, HostSource

log = logging.getLogger(__name__)

#: how long one run of the discovery script may take
SCRIPT_TIMEOUT_S = 10.0
#: how much of a failing script's output an error message quotes
_OUTPUT_QUOTE_CHARS = 2000
#: the most a discovery run may print (stdout and stderr together): a host list is a few
#: KiB; a script gone wrong (a log cat'ed, a binary) must not be read whole into memory
MAX_OUTPUT_BYTES = 1024 * 1024
_CHUNK = 64 * 1024


def parse_discovery_output(
    text: str, default_slots: int = 1, max_slots: Optional[int] = None
) -> List[HostSlots]:
    """Parse ``host[:slots]`` lines (see the module docstring); a host listed twice adds up.

    ``max_slots`` (--max-workers): a host with more slots is refused, so that a typo
    (``localhost:100000``) never plans a round of that many workers.

    Raises:
        HostDiscoveryError: a line is not ``[user@]host[:slots]`` with slots >= 1, or
            a host has more than ``max_slots`` slots (names the line).
    """
    order: List[str] = []
    found = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, slots_text = line.rpartition(":")
        if not sep:
            name, slots_text = line, str(default_slots)
        user, at, host = name.rpartition("@")
        bad = (
            not host
            or any(c.isspace() for c in line)
            or (at and not user)
            or any(c in host for c in ":/=,")
            or host_name_problem(host) is not None
        )
        try:
            slots = int(slots_text)
        except ValueError:
            bad, slots = True, 0
        if bad or slots < 1:
            raise HostDiscoveryError(
                f"line {number} ({raw.strip()!r}) is not 'host' or 'host:slots' with slots >= 1",
                output=text,
            )
        total = slots + (found[host].slots if host in found else 0)
        if max_slots is not None and total > max_slots:
            raise HostDiscoveryError(
                f"line {number} ({raw.strip()!r}): host {host!r} has {total} slots, "
                f"more than the {max_slots} worker processes one job may run "
                f"(--max-workers / {cfg.MAX_WORKERS})",
                output=text,
            )
        if host in found:
            prev = found[host]
            if prev.user != (user or None):
                raise HostDiscoveryError(
                    f"line {number}: host {host!r} is listed with two login names", output=text
                )
            found[host] = HostSlots(host, prev.slots + slots, prev.user)
        else:
            order.append(host)
            found[host] = HostSlots(host, slots, user or None)
    return [found[h] for h in order]


class ScriptHosts(HostSource):
    """Runs ``--host-discovery-script`` (an executable file) and parses its stdout.

    The script runs in its own session with a timeout; when it runs too long its
    whole process group (and any descendant) is killed, so a stuck ``ssh`` or
    ``sleep`` inside it cannot keep it (or its pipes) alive.
    """

    def __init__(
        self,
        script: str,
        default_slots: int = 1,
        timeout_s: float = SCRIPT_TIMEOUT_S,
        max_slots: Optional[int] = None,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
    ):
        self.script = os.path.abspath(script)
        self.default_slots = default_slots
        self.timeout_s = timeout_s
        self.max_slots = max_slots
        self.max_output_bytes = max_output_bytes
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._closed = False

    def find(self) -> List[HostSlots]:
        """Run the script once and parse what it printed.

        Raises:
            HostDiscoveryError: the script cannot be started, exits non-zero, runs
                past ``timeout_s`` or prints garbage; ``output`` holds its stdout and
                stderr.
        """
        with self._lock:
            if self._closed:
                raise HostDiscoveryError("host discovery was closed")
            try:
                # tied to our life like the workers: a killed launcher leaves no script
                proc = lifeline.popen(
                    [self.script],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            except OSError as exc:
                raise HostDiscoveryError(
                    f"--host-discovery-script {self.script}: cannot run it: {exc.strerror}"
                ) from None
            self._proc = proc
        try:
            out, err, why = _read_bounded(proc, self.timeout_s, self.max_output_bytes, self._end)
        finally:
            with self._lock:
                self._proc = None
        if why == "over":
            raise HostDiscoveryError(
                f"--host-discovery-script {self.script} printed more than "
                f"{self.max_output_bytes} bytes (one 'host[:slots]' line per host is "
                f"expected); it was ended",
                output=_both(out, err),
            )
        if why == "timeout":
            raise HostDiscoveryError(
                f"--host-discovery-script {self.script} did not finish within "
                f"{self.timeout_s:g}s; it was ended",
                output=_both(out, err),
            )
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            code = proc.returncode
            how = f"exited with code {code}" if code > 0 else f"was killed by signal {-code}"
            raise HostDiscoveryError(
                f"--host-discovery-script {self.script} {how}", output=_both(out, err)
            )
        try:
            return parse_discovery_output(text, self.default_slots, self.max_slots)
        except HostDiscoveryError as exc:
            raise HostDiscoveryError(
                f"--host-discovery-script {self.script}: {exc}", output=_both(out, err)
            ) from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc = self._proc
        if proc is not None:
            self._end(proc)

    @staticmethod
    def _end(proc: subprocess.Popen) -> None:
        """SIGKILL the script's process group (its own session), then any descendant that
        left the group; a discovery query has nothing to clean up."""
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for kid in kids:
            try:
                kid.kill()
            except psutil.NoSuchProcess:
                pass


def _both(out: Optional[bytes], err: Optional[bytes]) -> str:
    """The script's stdout and stderr as the log quotes them: cut, and printable."""
    text = (out or b"").decode(errors="replace")
    if err:
        text += (
            ("\n" if text and not text.endswith("\n") else "")
            + "[stderr] "
            + err.decode(errors="replace")
        )
    size = len(text)
    text = text[:_OUTPUT_QUOTE_CHARS]
    text = "\n".join(printable(line) for line in text.split("\n"))
    if size > _OUTPUT_QUOTE_CHARS or len(text) > _OUTPUT_QUOTE_CHARS:
        text = text[:_OUTPUT_QUOTE_CHARS]  # escapes are up to 10 characters each
        text += f"... ({size} characters in all)"
    return text


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\ufffd`` stays):
    a script's output is logged, and raw escape bytes would drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _read_bounded(proc: subprocess.Popen, timeout_s: float, limit: int, end):
    """Read the script's stdout and stderr until it exits, ``timeout_s`` passes or
    together they exceed ``limit`` bytes (then ``end(proc)`` kills its process group).

    Returns ``(stdout, stderr, why)``; ``why`` is None, ``"over"`` or ``"timeout"``.
    Only ``limit`` bytes are ever held, whatever the script prints.
    """
    buffers = {"out": bytearray(), "err": bytearray()}
    over = threading.Event()

    def pump(name, pipe):
        try:
            while not over.is_set():
                chunk = pipe.read1(_CHUNK)
                if not chunk:
                    return
                buffers[name] += chunk
                if len(buffers["out"]) + len(buffers["err"]) > limit:
                    over.set()
        except (OSError, ValueError):
            return  # the pipe was closed under us

    readers = [
        threading.Thread(target=pump, args=(n, p), daemon=True, name=f"hvdlite-discovery-{n}")
        for n, p in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout_s
    while (
        not over.is_set()
        and time.monotonic() < deadline
        and (proc.poll() is None or any(r.is_alive() for r in readers))
    ):
        over.wait(0.02)
    unfinished = proc.poll() is None or any(r.is_alive() for r in readers)
    why = "over" if over.is_set() else ("timeout" if unfinished else None)
    if why is not None:
        over.set()  # the readers stop at their next chunk
        end(proc)
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
    for r in readers:
        r.join(2.0)  # a grandchild may still hold a pipe
    for r, pipe in zip(readers, (proc.stdout, proc.stderr)):
        if not r.is_alive():  # closing under a blocked read could hang
            pipe.close()
    return bytes(buffers["out"][:limit]), bytes(buffers["err"][:limit]), why
