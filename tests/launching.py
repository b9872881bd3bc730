"""The one way the suite starts a job through ``hvdlite-run``: its command line, its
environment, a run bounded by a timeout that fails the test with the output so far, a
started job for tests that watch it live, and the processes a job leaves behind.

Every test that launches a job goes through here (``tests/test_layers.py`` checks that no
other test file spells the launcher's command), so a change to how jobs start -- an
environment variable every job needs, the launcher's module -- is made once.
"""

import os
import subprocess
import sys
from typing import Dict, Iterable, List, Mapping, Optional

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: this interpreter's bin folder: hvdlite-run, mpiexec and the interpreter itself
BIN = os.path.dirname(sys.executable)
#: the launcher, run by this interpreter (no installed entry point needed)
LAUNCHER = (sys.executable, "-m", "hvdlite.runner.cli.launch")


def command(*args) -> List[str]:
    """``hvdlite-run ARGS...`` as an argument list."""
    return [*LAUNCHER, *(str(a) for a in args)]


def environment(
    extra: Optional[Mapping[str, str]] = None,
    pythonpath: Iterable[str] = (),
    unset: Iterable[str] = (),
) -> Dict[str, str]:
    """This environment for a launch: this interpreter's bin folder first on PATH, no
    rank identity left over from the test process nor the variables ``unset`` names,
    ``pythonpath`` before the inherited PYTHONPATH, then ``extra``."""
    env = dict(os.environ)
    for name in ("HVDLITE_RANK", "HVDLITE_SIZE", *unset):
        env.pop(name, None)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    paths = [str(p) for p in pythonpath]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def _text(stream) -> str:
    if isinstance(stream, bytes):
        return stream.decode(errors="replace")
    return stream or ""


def run(
    args: Iterable,
    env: Optional[Mapping[str, str]] = None,
    timeout: float = 60,
    cwd: str = REPO,
    pythonpath: Iterable[str] = (),
    unset: Iterable[str] = (),
    **kw,
) -> "subprocess.CompletedProcess[str]":
    """Run ``hvdlite-run ARGS`` to its end; its exit code and output (text).  A job that
    outlives ``timeout`` seconds fails the test with what it printed."""
    argv = command(*args)
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environment(env, pythonpath, unset),
            cwd=cwd,
            **kw,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"hvdlite-run {' '.join(argv[len(LAUNCHER) :])} did not finish within "
            f"{timeout:g}s; output so far:\n{_text(exc.stdout)[-6000:]}\n"
            f"{_text(exc.stderr)[-6000:]}"
        )


def start(
    args: Iterable,
    env: Optional[Mapping[str, str]] = None,
    cwd: str = REPO,
    pythonpath: Iterable[str] = (),
    unset: Iterable[str] = (),
    **popen_kw,
) -> subprocess.Popen:
    """Start ``hvdlite-run ARGS`` and return it running (the caller waits, reads, signals);
    stdout and stderr are pipes of text unless ``popen_kw`` says otherwise."""
    popen_kw.setdefault("stdout", subprocess.PIPE)
    popen_kw.setdefault("stderr", subprocess.PIPE)
    popen_kw.setdefault("text", True)
    return subprocess.Popen(
        command(*args), env=environment(env, pythonpath, unset), cwd=cwd, **popen_kw
    )


def leftovers(token: str) -> List[psutil.Process]:
    """Live processes (zombies aside) whose command line holds ``token`` other than a
    launcher: what a job that has ended must not leave."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = p.info["cmdline"] or []
            if p.info["status"] == psutil.STATUS_ZOMBIE or LAUNCHER[-1] in cmdline:
                continue
            if any(token in part for part in cmdline):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
