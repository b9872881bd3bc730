"""Rank output: whole lines tagged ``[rank]<stdout>:`` / ``[rank]<stderr>:``.

Both launch modes use the pieces here:

* :class:`OutputSink` and :func:`pump_lines` -- the Gloo launcher and its tasks
  (``processes.workers.WorkerGroup``) read every rank's pipes and write tagged lines.
* :func:`main` -- under ``--mpi``, mpiexec starts the ranks itself, so each rank
  runs as ``python -m hvdlite.runner.processes.rank_output [--output-dir DIR] -- CMD...``
  (see :func:`wrapper_command`).  The wrapper reads its rank from the MPI
  environment, starts ``CMD`` with piped stdout/stderr and
  ``PYTHONUNBUFFERED=1``, and writes each whole line to its own stdout/stderr
  with the tag, once per ``write``.  ``print()`` without ``flush=True`` then shows
  up at once, and mpiexec forwards whole lines.

The child stays the MPI process: it inherits the environment and every file
descriptor the wrapper inherited (Hydra's ``PMI_FD`` among them), so
``MPI_Init`` in the child connects to the process manager exactly as it would
without the wrapper.  The wrapper never initialises MPI.  SIGINT/SIGTERM/SIGHUP
are forwarded to the child's process group; on Linux the child also gets
SIGKILL should the wrapper die without forwarding (mpiexec's SIGKILL).  The
wrapper exits with the child's code, 128+N for signal N.

This module imports no framework (only the standard library, psutil and
:mod:`hvdlite.runner.processes.workers`), so it starts fast on every rank and never imports torch.
"""

import argparse
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hvdlite.common.exceptions import HvdliteConfigError, HvdliteError, HvdliteLaunchError
from hvdlite.runner.processes import lifeline
from hvdlite.runner.processes.merged_lines import RankLineMerger
from hvdlite.runner.processes.workers import describe_exit, exit_status

#: where MPI implementations put the world rank, tried in order:
#: Open MPI, PMIx (Open MPI 5 / PRRTE), MPICH Hydra and Intel MPI.
#: (Intel's MPI_LOCALRANKID is the rank on the host, not in the world.)
RANK_ENV_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
#: bounded wait for the last output once the child has exited
#: (a grandchild that keeps the pipes open must not keep the rank alive)
OUTPUT_DRAIN_S = 5.0
MODULE = "hvdlite.runner.processes.rank_output"
#: the first line of a Python traceback
_TRACEBACK = "Traceback (most recent call last):"
#: what torch.distributed's exception hook writes before each line of a traceback
_TORCH_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
#: the line of a traceback that names the exception (``RuntimeError: boom``); group 1 is
#: the exception's (possibly dotted) name
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failed))\b")
#: how the C++ runtime announces std::terminate (then SIGABRT): a native library's last
#: words, printed with no Python traceback
_TERMINATE = "terminate called "
#: what the summary adds to last words that say little by themselves
_EXPLAINED = {
    "terminate called without an active exception": "a C++ thread was still running as the process ended; under torch.distributed "
    "that is usually a Gloo process group freed only at exit (e.g. a "
    "DistributedDataParallel model still alive): call gc.collect() before "
    "dist.destroy_process_group()",
}


class OutputSink:
    """Where rank output lines go: prefixed to our stdout/stderr, optionally to files.

    ``write`` takes one whole line; a lock keeps lines from interleaving.
    With ``output_dir``, each line (without the tag) also goes to
    ``output_dir/rank.N/stdout`` or ``.../stderr``.  The sink also remembers the last
    exception each rank printed after a traceback, or the C++ runtime's ``terminate
    called ...`` before an abort (:meth:`raised`): what a rank that never reached
    ``hvd.init()`` -- or never imports hvdlite, as a plain DDP program -- died of, for
    the failure summary.
    """

    def __init__(
        self,
        out=None,
        err=None,
        output_dir: Optional[str] = None,
        timestamp: bool = False,
        merge_ranks: Optional[int] = None,
    ):
        self._out = out if out is not None else sys.stdout.buffer
        self._err = err if err is not None else sys.stderr.buffer
        self._output_dir = output_dir
        self._timestamp = timestamp
        self._files: Dict[Tuple[int, str], object] = {}
        self._lock = threading.Lock()
        self.broken = threading.Event()
        #: rank -> (its last exception line after a traceback, when it came)
        self._raised: Dict[int, Tuple[str, float]] = {}
        self._in_traceback: Dict[int, bool] = {}
        #: ranks whose last stderr line was the C++ runtime's "terminate called ..."
        self._terminating: Dict[int, bool] = {}
        #: (rank, stream) whose progress update ends the terminal's current line (no \n)
        self._open_progress: Optional[Tuple[int, str]] = None
        #: stderr lines that every one of ``merge_ranks`` ranks prints are printed once
        self._merger = (
            RankLineMerger(merge_ranks, self._emit_merged)
            if merge_ranks and merge_ranks > 1
            else None
        )

    def _prefix(self, label, stream: str) -> bytes:
        prefix = f"[{label}]<{stream}>:".encode()
        if self._timestamp:
            prefix = datetime.datetime.now().strftime("%a %b %d %H:%M:%S %Y").encode() + prefix
        return prefix

    def write(self, rank: int, stream: str, line: bytes) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        with self._lock:
            if stream == "stderr":
                self._note_exception(rank, line)
            self._to_file(rank, stream, line)
            if self._merger is None or stream != "stderr":
                self._show(self._prefix(rank, stream), stream, line, (rank, stream))
        if self._merger is not None and stream == "stderr":
            self._merger.add(rank, line)  # not under our lock: it prints through it

    def progress(self, rank: int, stream: str, text: bytes) -> None:
        """One ``\\r`` update of a progress bar (tqdm's): on a terminal it replaces the
        rank's previous update in place; elsewhere it is a line of its own."""
        with self._lock:
            self._to_file(rank, stream, text + b"\r")
            sink = self._out if stream == "stdout" else self._err
            prefix = self._prefix(rank, stream)
            if not _is_tty(sink):
                self._show(prefix, stream, text + b"\n", (rank, stream))
                return
            lead = (
                b"\r"
                if self._open_progress == (rank, stream)
                else (b"\n" if self._open_progress is not None else b"")
            )
            self._put(sink, lead + prefix + text)
            self._open_progress = (rank, stream)

    def _emit_merged(self, label: str, line: bytes) -> None:
        with self._lock:
            self._show(self._prefix(label, "stderr"), "stderr", line, None)

    def _show(self, prefix: bytes, stream: str, line: bytes, who) -> None:
        """Print one tagged line (our lock held), ending an open progress update first:
        the rank's own final line replaces it, anyone else's goes below it."""
        sink = self._out if stream == "stdout" else self._err
        lead = b""
        if self._open_progress is not None:
            lead = b"\r" if self._open_progress == who else b"\n"
            self._open_progress = None
        self._put(sink, lead + prefix + line)

    def _put(self, sink, data: bytes) -> None:
        try:
            sink.write(data)
            sink.flush()
        except (OSError, ValueError):
            self.broken.set()

    def _to_file(self, rank: int, stream: str, data: bytes) -> None:
        if not self._output_dir:
            return
        f = self._files.get((rank, stream))
        if f is None:
            rank_dir = os.path.join(self._output_dir, f"rank.{rank}")
            os.makedirs(rank_dir, exist_ok=True)
            f = self._files[(rank, stream)] = open(os.path.join(rank_dir, stream), "wb")
        f.write(data)
        f.flush()

    def flush_pending(self) -> None:
        """Print the stderr lines still held for merging (before the job's summary)."""
        if self._merger is not None:
            self._merger.flush()

    def _note_exception(self, rank: int, line: bytes) -> None:
        # torch.distributed's exception hook prefixes each line with "[rankN]: "
        text = _TORCH_PREFIX.sub("", line.decode("utf-8", "replace").rstrip(), count=1)
        terminating = self._terminating.pop(rank, False)
        if text.startswith(_TRACEBACK):
            self._in_traceback[rank] = True
        elif self._in_traceback.get(rank) and EXCEPTION_LINE.match(text):
            self._raised[rank] = (text, time.monotonic())
            self._in_traceback[rank] = False
        elif text.startswith(_TERMINATE):
            explained = _EXPLAINED.get(text)
            self._raised[rank] = (f"{text} ({explained})" if explained else text, time.monotonic())
            self._terminating[rank] = True
        elif terminating and text.strip().startswith("what():"):
            said, at = self._raised[rank]  # the exception C++ did not catch
            self._raised[rank] = (f"{said}: {text.strip()[len('what():') :].strip()}", at)

    def raised(self) -> Dict[int, Tuple[str, float]]:
        """Each rank's last exception line printed after a traceback (or the C++
        runtime's ``terminate called ...``), with when it came (``time.monotonic()``), by
        the rank the worker started with."""
        with self._lock:
            return dict(self._raised)

    def attach(self, rank: int, stream: str, pipe: IO[bytes]) -> threading.Thread:
        """Start a thread that writes each line of ``pipe`` as ``rank``'s ``stream``."""
        return pump_lines(
            pipe,
            lambda line: self.write(rank, stream, line),
            name=f"output-rank{rank}-{stream}",
            on_progress=lambda text: self.progress(rank, stream, text),
        )

    def close(self) -> None:
        if self._merger is not None:
            self._merger.close()
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def _is_tty(sink) -> bool:
    try:
        return sink.isatty()
    except (AttributeError, OSError, ValueError):
        return False


def _pieces(stream):
    """``(piece, is_progress)`` for each line of ``stream`` (ending in ``\\n``) and each
    progress update (text after a lone ``\\r``, as tqdm writes it) until EOF.  An update
    is handed on once read, not when the next one comes; a bar's closing ``\\n`` hands
    on its last update as a line."""
    read = getattr(stream, "read1", None) or stream.read
    buf = b""
    update: Optional[bytes] = None  # the text after the last lone \r, once handed on
    while True:
        chunk = read(65536)
        if not chunk:
            break
        buf += chunk
        while buf:
            nl, cr = buf.find(b"\n"), buf.find(b"\r")
            if cr != -1 and (nl == -1 or cr < nl):
                if cr == len(buf) - 1:
                    break  # the \r of a \r\n cut in two: wait
                if buf[cr + 1 : cr + 2] == b"\n":
                    yield buf[:cr] + b"\n", False
                    buf, update = buf[cr + 2 :], None
                    continue
                if cr:
                    yield buf[:cr], True  # the update this \r ends
                buf, update = buf[cr + 1 :], b""
                continue
            if nl == -1:
                break
            line, buf = buf[: nl + 1], buf[nl + 1 :]
            if line == b"\n" and update:
                line = update + line  # the bar's last state, as its line
            yield line, False
            update = None
        if buf and update is not None and b"\r" not in buf:
            yield buf, True  # an update written in one go: show it now
            buf, update = b"", buf
    if buf:
        yield buf.rstrip(b"\r"), False


def pump_lines(
    stream,
    on_line: Callable[[bytes], None],
    name: str,
    on_progress: Optional[Callable[[bytes], None]] = None,
) -> threading.Thread:
    """Start a thread that hands each line of ``stream`` to ``on_line`` until EOF, and each
    ``\\r`` progress update to ``on_progress`` (default: ``on_line``, as a line)."""
    progress = on_progress or (lambda text: on_line(text + b"\n"))

    def run():
        try:
            for piece, is_progress in _pieces(stream):
                (progress if is_progress else on_line)(piece)
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


# ----------------------------------------------------------------------------------------
# the per-rank wrapper of MPI mode


def wrapper_command(
    command: Sequence[str],
    output_dir: Optional[str] = None,
    timestamp: bool = False,
    python: str = sys.executable,
) -> List[str]:
    """The command mpiexec runs on every rank to run ``command`` under the wrapper."""
    cmd = [python, "-m", MODULE]
    if output_dir:
        cmd += ["--output-dir", output_dir]
    if timestamp:
        cmd += ["--timestamp"]
    return cmd + ["--"] + list(command)


def mpi_rank(environ: Mapping[str, str]) -> int:
    """This process's rank in MPI_COMM_WORLD, from the variables mpiexec sets.

    Raises:
        HvdliteConfigError: none of :data:`RANK_ENV_VARS` holds a rank.
    """
    for name in RANK_ENV_VARS:
        value = environ.get(name)
        if value is None:
            continue
        try:
            return int(value)
        except ValueError:
            raise HvdliteConfigError(f"{name}={value!r}: not a rank number") from None
    raise HvdliteConfigError(
        f"{MODULE}: no MPI rank in the environment (expected one of "
        f"{', '.join(RANK_ENV_VARS)}); it is meant to be started by mpiexec through "
        f"hvdlite-run --mpi"
    )


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description="Run one MPI rank's command with its output "
        "tagged [rank]<stdout>: / [rank]<stderr>:.",
    )
    p.add_argument(
        "--output-dir",
        metavar="DIR",
        help="also write the rank's lines to DIR/rank.N/stdout and stderr",
    )
    p.add_argument("--timestamp", action="store_true", help="prefix each line with the time")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the rank's command")
    args = p.parse_args(list(argv))
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command given (usage: ... -- COMMAND ARGS...)")
    return args


def run_rank(
    command: Sequence[str], rank: int, sink: OutputSink, environ: Optional[Mapping[str, str]] = None
) -> int:
    """Run ``command`` as rank ``rank``, its output through ``sink``; returns our exit status.

    Raises:
        HvdliteLaunchError: the command cannot be started.
    """
    env = dict(os.environ if environ is None else environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        # close_fds=False: the child gets every descriptor mpiexec gave us (PMI_FD)
        proc = lifeline.popen(
            list(command),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=False,
            start_new_session=True,
        )
    except OSError as exc:
        raise HvdliteLaunchError(
            f"rank {rank} on host {socket.gethostname()}: cannot start "
            f"{command[0]!r}: {exc.strerror}"
        ) from None
    # Our copy of the PMI connection (Hydra's PMI_FD) stays open until we exit: Hydra
    # takes an EOF on it without a finalize as an abort and SIGKILLs the job, so the EOF
    # must come with our exit code, as it does without the wrapper, not before it.
    signalled = threading.Event()

    def forward(signum, frame):
        signalled.set()
        try:
            os.killpg(proc.pid, signum)
        except OSError:  # the group is already gone
            pass

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, forward) for s in forwarded}
    try:
        pumps = [sink.attach(rank, "stdout", proc.stdout), sink.attach(rank, "stderr", proc.stderr)]
        code = proc.wait()
        deadline = time.monotonic() + OUTPUT_DRAIN_S
        for t in pumps:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sink.close()
    if code != 0 and not signalled.is_set():
        _report(f"hvdlite-run: rank {rank} on host {socket.gethostname()} {describe_exit(code)}.\n")
    return 0 if code == 0 else exit_status(code)


def _report(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    # Hydra's proxy is our parent: if it dies (mpiexec or the launcher was killed), we get
    # SIGTERM, which ends the child's group below, and the child is tied to us in turn
    lifeline.set_own_death_signal(signal.SIGTERM)
    try:
        rank = mpi_rank(os.environ)
        sink = OutputSink(output_dir=args.output_dir, timestamp=args.timestamp)
        return run_rank(args.command, rank, sink)
    except HvdliteError as exc:
        _report(f"hvdlite-run: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
