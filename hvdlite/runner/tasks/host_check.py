"""``hvdlite-run --check-hosts -H a,b [python train.py]``: does each host have what a job
needs there?  Checked item by item, each failure named with its fix.

A job on plain SSH hosts needs, on every host: a login with a key (no password prompt),
hvdlite-run's own Python at the same path (the task service runs with it), the command's
interpreter (found on that host's PATH or at its path) able to import hvdlite and torch,
the launcher's working directory (else the ranks start in the home directory, and
relative paths break), and TCP from the host back to the launcher's host on any port (the
rendezvous store and the driver listen on ephemeral ports).  A probe run on the host
with hvdlite-run's Python tests each; a local host runs the same probe without SSH.
"""

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
from typing import List, Optional, Sequence, Tuple

from hvdlite.common.exceptions import HvdliteError
from hvdlite.runner.hosts import HostSlots, is_local
from hvdlite.runner.tasks.ssh import SSHOptions, ssh_connect

#: bound on one host's probe (login included)
PROBE_TIMEOUT_S = 30.0

#: run on the host by hvdlite-run's Python: argv = cwd, command's interpreter or "",
#: launcher address, port; prints one JSON object
_PROBE = r"""
import json, os, shutil, socket, subprocess, sys
cwd, exe, addr, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
out = {"python": sys.executable, "cwd": os.path.isdir(cwd)}
def versions(python):
    code = ("import importlib.util as u, importlib.metadata as m, json; print(json.dumps("
            "{n: (m.version(n) if u.find_spec(n) else None) for n in ('hvdlite', 'torch')}))")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=20)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-300:]}
out["own"] = versions(sys.executable)
if exe:
    if out["cwd"]:
        os.chdir(cwd)
    found = shutil.which(exe) if os.sep not in exe else (exe if os.access(exe, os.X_OK) else None)
    out["command"] = found
    if found and os.path.basename(exe).startswith("python"):
        out["command_modules"] = versions(found)
try:
    socket.create_connection((addr, port), 5).close()
    out["back"] = None
except OSError as exc:
    out["back"] = str(exc)
print(json.dumps(out))
"""


def _probe_command(python: str, cwd: str, exe: str, addr: str, port: int) -> str:
    q = shlex.quote
    return (f"if [ ! -x {q(python)} ]; then echo '{{\"missing_python\": true}}'; exit 0; fi; "
            f"exec {q(python)} -c {q(_PROBE)} {q(cwd)} {q(exe)} {q(addr)} {port}")


class _Listener:
    """A port on this host that the probes connect back to (as the job's services)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="check-hosts").start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
                conn.close()
            except OSError:
                return

    def close(self):
        self.sock.close()


def _run_probe(host: HostSlots, opts: SSHOptions, command: str
               ) -> Tuple[Optional[dict], Optional[str], Optional[str]]:
    """``(probe's answer, error, launcher address it used)`` for one host."""
    if is_local(host.hostname):
        r = subprocess.run(["sh", "-c", command.replace("@ADDR@", "127.0.0.1")],
                           capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        return _answer(r.stdout, r.stderr), None, "127.0.0.1"
    try:
        client = ssh_connect(host, opts, PROBE_TIMEOUT_S)
    except HvdliteError as exc:
        return None, str(exc), None
    try:
        addr = client.get_transport().sock.getsockname()[0]
        _, stdout, stderr = client.exec_command(command.replace("@ADDR@", addr),
                                                timeout=PROBE_TIMEOUT_S)
        return _answer(stdout.read().decode(), stderr.read().decode()), None, addr
    except Exception as exc:  # noqa: BLE001 - paramiko's and the socket's errors, reported
        return None, f"the probe did not finish: {exc}", None
    finally:
        client.close()


def _answer(stdout: str, stderr: str) -> Optional[dict]:
    for line in reversed(stdout.splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {"probe_failed": (stderr or stdout)[-300:]}


def _items(host: str, answer: Optional[dict], error: Optional[str], addr: Optional[str],
           port: int, python: str, cwd: str, exe: str) -> List[Tuple[bool, str]]:
    """``[(ok, what)]``: each item checked on ``host``, failures with their fix."""
    if error is not None:
        return [(False, f"SSH login with a key: {error}")]
    items = [(True, "SSH login with a key" if not is_local(host) else "this host (no SSH)")]
    if answer.get("missing_python"):
        return items + [(False, f"hvdlite-run's Python {python}: not on {host}; every host "
                                f"needs it at the same path (make the same virtual "
                                f"environment there, e.g. python3 -m venv {_venv(python)} "
                                f"and pip install hvdlite into it)")]
    if "probe_failed" in answer:
        return items + [(False, f"the probe failed on {host}: {answer['probe_failed']}")]
    own = answer.get("own", {})
    items.append((bool(own.get("hvdlite")),
                  f"hvdlite-run's Python {python}: " + (
                      f"hvdlite {own['hvdlite']}, torch {own.get('torch') or 'missing'}"
                      if own.get("hvdlite") else f"cannot import hvdlite on {host} "
                      f"(pip install hvdlite into {_venv(python)} there)")))
    items.append((bool(answer.get("cwd")),
                  f"working directory {cwd}" + ("" if answer.get("cwd") else
                                                f": missing on {host}; the ranks would start "
                                                f"in the home directory (copy or mount it "
                                                f"at the same path)")))
    if exe:
        found, mods = answer.get("command"), answer.get("command_modules")
        if not found:
            items.append((False, f"the command's interpreter {exe}: not found on {host} "
                                 f"(make that environment there at the same path, or give "
                                 f"a path every host has)"))
        elif mods is not None:
            lacks = [m for m in ("hvdlite", "torch") if not mods.get(m)]
            items.append((not lacks, f"the command's interpreter {found}: " + (
                f"cannot import {', '.join(lacks)} on {host}" if lacks else
                f"hvdlite {mods['hvdlite']}, torch {mods['torch']}")))
        else:
            items.append((True, f"the command {found}"))
    back = answer.get("back")
    items.append((back is None, f"TCP from {host} back to this host ({addr}:{port})" + (
        "" if back is None else f": {back} (open TCP from the hosts to this one on any port, "
                                f"or name a routable interface with --network-interfaces)")))
    return items


def _venv(python: str) -> str:
    parent = os.path.dirname(os.path.dirname(python))
    return parent or python


def check_hosts(hosts: Sequence[HostSlots], opts: SSHOptions,
                command: Sequence[str]) -> Tuple[bool, str]:
    """``(every item passed, the report)`` for ``hosts``, checked one after the other."""
    listener = _Listener()
    cwd, exe = os.getcwd(), (command[0] if command else "")
    lines: List[str] = [f"hvdlite-run --check-hosts: {len(hosts)} host(s), from this host's "
                        f"{cwd} with {opts.python}"]
    passed = True
    try:
        for host in hosts:
            probe = _probe_command(opts.python, cwd, exe, "@ADDR@", listener.port)
            answer, error, addr = _run_probe(host, opts, probe)
            lines.append(host.ssh_target)
            for ok, what in _items(host.hostname, answer, error, addr, listener.port,
                                   opts.python, cwd, exe):
                passed = passed and ok
                lines.append(f"  {'[ok]  ' if ok else '[FAIL]'} {what}")
    finally:
        listener.close()
    lines.append("every host has what a job needs" if passed else
                 "some hosts lack what a job needs: see [FAIL] above")
    return passed, "\n".join(lines)


def main(hosts: Sequence[HostSlots], opts: SSHOptions, command: Sequence[str]) -> int:
    ok, report = check_hosts(hosts, opts, command)
    print(report)
    sys.stdout.flush()
    return 0 if ok else 1

