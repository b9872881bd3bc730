"""A process's Python stacks taken from outside it, with py-spy.

A rank's own threads send its stacks when asked (``hvdlite.common.diagnostics.stack_capture``),
but some ranks cannot: a program that never calls ``hvd.init()`` runs no hvdlite thread, and a
rank whose interpreter lock is held by a C call runs no Python thread at all.  py-spy reads
the interpreter's memory from outside (``ptrace``, ``process_vm_readv``) and needs no
cooperation, so it shows those ranks too.

:func:`dump` runs ``py-spy dump --pid PID --json`` once, bounded by ``timeout_s`` (the
subprocess is killed after it), and turns its output into the form a rank sends about
itself (:func:`stack_capture.capture`: ``[{"name", "main", "frames": [[path, line,
function, runtime], ...]}]``, frames outermost first, the main thread first), plus
``"gil": True`` on the thread that holds the interpreter lock.  :func:`dump_tree` does the
same for a worker whose process may be a shell or a wrapper: it tries the process and its
descendants.  When there are no stacks, :attr:`OutsideStack.note` says why: py-spy is not
installed, may not attach (ptrace denied), the process is not Python, has ended, or py-spy
timed out.

py-spy is found beside this interpreter first (a virtual environment's ``bin/``, which
need not be on PATH), then on PATH.  It pauses the process for the moment it reads it.
"""

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import psutil

from hvdlite.common.diagnostics.stack_capture import MAX_FRAMES, MAX_THREADS, is_runtime_file

#: the most processes of one tree :func:`dump_tree` hands to py-spy
MAX_TRIES = 8
#: the most bytes of py-spy's output that are read as its JSON
MAX_OUTPUT_BYTES = 16 * 1024 * 1024
#: what to do where py-spy is missing
INSTALL_HINT = "pip install py-spy, or pip install 'hvdlite[diagnostics]'"

_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


@dataclasses.dataclass
class OutsideStack:
    """The stacks of one process, taken from outside it.

    ``pid``: the process py-spy read (for a tree, the descendant it chose); ``threads``:
    its threads in :func:`stack_capture.capture`'s form, or None; ``note``: why there are
    none ("" when there are)."""

    pid: int
    threads: Optional[list]
    note: str = ""


def find_py_spy() -> Optional[str]:
    """The py-spy beside this interpreter, else the one on PATH, else None."""
    return shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")


def dump(pid: int, timeout_s: float = 10.0) -> OutsideStack:
    """Every Python thread of process ``pid``, read by ``py-spy dump --json`` within
    ``timeout_s`` seconds.  Never raises for what py-spy or the process does: the
    result's note says why there are no threads."""
    exe = find_py_spy()
    if exe is None:
        return OutsideStack(pid, None, f"py-spy is not installed on this host ({INSTALL_HINT})")
    timeout_s = max(0.1, float(timeout_s))
    try:
        done = subprocess.run(
            [exe, "dump", "--pid", str(int(pid)), "--json"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            env=dict(os.environ, RUST_BACKTRACE="0"),
        )
    except subprocess.TimeoutExpired:
        return OutsideStack(pid, None, f"py-spy did not finish within {timeout_s:g}s")
    except OSError as exc:
        return OutsideStack(pid, None, f"cannot run {exe}: {exc.strerror or exc}")
    if done.returncode == 0:
        try:
            raw = json.loads(done.stdout[:MAX_OUTPUT_BYTES])
        except ValueError as exc:
            return OutsideStack(pid, None, f"py-spy's output is not JSON: {exc}")
        threads = from_py_spy(raw, pid)
        if threads is None:
            return OutsideStack(pid, None, "py-spy's output is not a list of threads")
        return OutsideStack(pid, threads, "")
    return OutsideStack(pid, None, _why_failed(pid, done.stderr.decode(errors="replace")))


def from_py_spy(raw, pid: int) -> Optional[List[dict]]:
    """py-spy's JSON threads (frames innermost first) in :func:`stack_capture.capture`'s
    form (outermost first, the innermost :data:`MAX_FRAMES` kept, the main thread first,
    at most :data:`MAX_THREADS`); None when ``raw`` is not py-spy's list of threads."""
    if not isinstance(raw, list):
        return None
    threads = []
    for entry in raw:
        if not isinstance(entry, dict) or not isinstance(entry.get("frames"), list):
            continue
        frames = []
        for frame in entry["frames"][:MAX_FRAMES]:
            if not isinstance(frame, dict):
                continue
            path = str(frame.get("filename") or frame.get("short_filename") or "?")
            line = frame.get("line")
            frames.append(
                [
                    path,
                    line if isinstance(line, int) else 0,
                    str(frame.get("name") or "?"),
                    is_runtime_file(path),
                ]
            )
        frames.reverse()
        tid = entry.get("os_thread_id") or entry.get("thread_id")
        main = tid == pid
        name = entry.get("thread_name") or ("MainThread" if main else f"thread {tid}")
        thread = {"name": str(name), "main": main, "frames": frames}
        if entry.get("owns_gil") is True:
            thread["gil"] = True
        threads.append(thread)
    threads.sort(key=lambda t: not t["main"])
    return threads[:MAX_THREADS]


def valid_threads(raw) -> Optional[List[dict]]:
    """``raw`` (threads another host sent, as JSON) kept to the well-formed threads and
    frames of :func:`stack_capture.capture`'s form, within its bounds; None when it is not
    a list."""
    if not isinstance(raw, list):
        return None
    threads = []
    for thread in raw[:MAX_THREADS]:
        if not isinstance(thread, dict) or not isinstance(thread.get("frames"), list):
            continue
        frames = [
            [str(f[0]), f[1], str(f[2]), f[3]]
            for f in thread["frames"][-MAX_FRAMES:]
            if isinstance(f, list)
            and len(f) == 4
            and isinstance(f[1], int)
            and isinstance(f[3], bool)
        ]
        kept = {
            "name": str(thread.get("name", "?"))[:200],
            "main": thread.get("main") is True,
            "frames": frames,
        }
        if thread.get("gil") is True:
            kept["gil"] = True
        threads.append(kept)
    return threads


def dump_tree(pid: int, timeout_s: float = 10.0) -> OutsideStack:
    """The stacks of the rank in the process tree of ``pid``: the process itself, or -- when
    it is a shell or a wrapper -- a descendant, all within ``timeout_s`` seconds.

    Python processes are tried nearest first (``pid``, its children, theirs ...): the
    first whose stacks hold code of the user's is the rank (the processes it starts,
    data-loader workers, come after it); a Python process that runs only installed code
    (a wrapper such as ``conda run``) is passed over for its descendants, and returned
    when none of them holds the user's code either."""
    deadline = time.monotonic() + max(0.1, float(timeout_s))
    try:
        root = psutil.Process(pid)
        tree = _nearest_first(root)
    except psutil.NoSuchProcess:
        return OutsideStack(pid, None, f"pid {pid} has exited")
    except psutil.AccessDenied:
        return OutsideStack(pid, None, f"pid {pid} is not this user's process")
    pythons = [p for p in tree if _looks_like_python(p)][:MAX_TRIES]
    if not pythons:
        others = len(tree) - 1
        return OutsideStack(
            pid,
            None,
            f"pid {pid} ({_name(root)}) is not a Python process"
            + (f", nor is any of its {others} descendants" if others else ""),
        )
    readable: Optional[OutsideStack] = None
    failed: Optional[OutsideStack] = None
    for proc in pythons:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        got = dump(proc.pid, left)
        if got.threads is not None:
            if _has_user_frames(got.threads):
                return got
            readable = readable or got
        else:
            failed = failed or got
            if "ptrace" in got.note or "not installed" in got.note:
                break  # no other process of the tree would do better
    return (
        readable
        or failed
        or OutsideStack(pid, None, f"py-spy did not finish within {timeout_s:g}s")
    )


def _nearest_first(root: psutil.Process) -> List[psutil.Process]:
    """``root`` and its descendants, breadth first."""
    out, todo = [], collections.deque([root])
    seen = set()
    while todo and len(out) < 256:
        proc = todo.popleft()
        if proc.pid in seen:
            continue
        seen.add(proc.pid)
        out.append(proc)
        try:
            todo.extend(sorted(proc.children(), key=lambda p: p.pid))
        except psutil.Error:
            pass
    return out


def _looks_like_python(proc: psutil.Process) -> bool:
    """The executable is named python*, or a libpython is mapped (an embedded interpreter)."""
    try:
        names = [os.path.basename(proc.exe()), proc.name()]
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    if cmd:
        names.append(os.path.basename(cmd[0]))
    if any(n.startswith("python") or n.startswith("pypy") for n in names):
        return True
    try:
        with open(f"/proc/{proc.pid}/maps", "rb") as maps:
            return b"libpython" in maps.read(1 << 22)
    except OSError:
        return False


def _has_user_frames(threads: List[dict]) -> bool:
    return any(not frame[3] for t in threads for frame in t["frames"])


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def _why_failed(pid: int, stderr: str) -> str:
    """The note for a py-spy that exited non-zero, from what it printed."""
    said = _py_spy_error(stderr)
    low = stderr.lower()
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return f"pid {pid} has exited"
    except psutil.Error:
        status = ""
    if status == psutil.STATUS_ZOMBIE:
        return f"pid {pid} has exited"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return (
            f"pid {pid} is stopped (SIGSTOP, or a debugger holds it), and py-spy cannot "
            f"read a stopped process ({said})"
        )
    if (
        "permission denied" in low
        or "operation not permitted" in low
        or "os error 1)" in low
        or "os error 13)" in low
    ):
        return (
            f"py-spy may not attach to pid {pid} (ptrace denied: {said}); in a container, "
            f"start it with --cap-add SYS_PTRACE; on a host, allow it with "
            f"'sysctl kernel.yama.ptrace_scope=0'{_yama_now()} or run the launcher's "
            f"tasks as root"
        )
    if "python version" in low or "python interpreter" in low or "not a python" in low:
        return f"pid {pid} is not a Python process py-spy can read ({said})"
    return f"py-spy failed on pid {pid}: {said}"


def _py_spy_error(stderr: str) -> str:
    """py-spy's error line and its first cause, without the backtrace."""
    error, cause, in_causes = "", "", False
    for line in (ln.strip() for ln in stderr.splitlines()):
        if not line:
            continue
        if line.startswith("Stack backtrace"):
            break
        if line.startswith("Caused by"):
            in_causes = True
        elif in_causes and not cause:
            cause = line.split(":", 1)[1].strip() if line[:1].isdigit() else line
        elif not error:
            error = line[len("Error:") :].strip() if line.startswith("Error:") else line
    said = f"{error}: {cause}" if error and cause else (error or cause or "no message")
    return said[:300]


def _yama_now() -> str:
    try:
        with open(_YAMA) as f:
            return f" (it is {f.read().strip()} now)"
    except OSError:
        return ""


def dumps(pids: Dict[object, int], timeout_s: float) -> Dict[object, OutsideStack]:
    """:func:`dump_tree` of several processes at once, all within ``timeout_s``, by the
    caller's key."""
    if not pids:
        return {}
    deadline = time.monotonic() + max(0.1, float(timeout_s))

    def one(pid: int) -> OutsideStack:
        left = deadline - time.monotonic()
        if left <= 0.1:
            return OutsideStack(
                pid, None, f"not taken: py-spy's {timeout_s:g}s ran out on the other processes"
            )
        return dump_tree(pid, left)

    with ThreadPoolExecutor(
        max_workers=min(16, len(pids)), thread_name_prefix="hvdlite-py-spy"
    ) as pool:
        futures = {key: pool.submit(one, pid) for key, pid in pids.items()}
        return {key: fut.result() for key, fut in futures.items()}
