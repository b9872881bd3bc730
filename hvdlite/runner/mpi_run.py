"""MPI mode: build and run the ``mpiexec`` command.

The flavour is detected from ``mpiexec --version``: MPICH's Hydra, Open MPI,
or Intel MPI (Hydra-based, ``-genv`` too).  Each gets its own flags for
hosts/slots and environment.  Rank identity comes from MPI itself; the launcher
only passes the tunables and ``HVDLITE_CPU_OPERATIONS=mpi``.

Output is tagged as in Gloo mode, ``[rank]<stdout>:`` / ``[rank]<stderr>:`` with
whole lines, not by mpiexec: every rank runs under the small wrapper of
:mod:`hvdlite.runner.rank_output`, which also writes ``--output-filename``'s
``DIR/rank.N/stdout|stderr`` files (on the rank's host).
"""

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import psutil

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteLaunchError
from hvdlite.runner import lifeline
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.procs import StopSignals, describe_exit, exit_status, kill_tree
from hvdlite.runner.rank_output import wrapper_command

log = logging.getLogger(__name__)

HYDRA, OPENMPI, INTEL = "mpich-hydra", "openmpi", "intel-mpi"


def find_mpiexec() -> Optional[str]:
    """mpiexec on PATH, else the one beside this interpreter (the ``mpich`` wheel puts it in
    the virtual environment's bin/, which need not be on PATH)."""
    here = os.path.dirname(sys.executable)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name) or shutil.which(name, path=here)
        if found:
            return found
    return None


def detect_flavor(mpiexec: str, timeout_s: float = 10.0) -> str:
    """Which MPI ``mpiexec`` belongs to.

    Raises:
        HvdliteConfigError: it cannot be run or is not one we know.
    """
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HvdliteConfigError(f"--mpi: cannot run {mpiexec} --version: {exc}") from None
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return OPENMPI
    if "intel" in text:
        return INTEL
    if "hydra" in text or "mpich" in text:
        return HYDRA
    raise HvdliteConfigError(
        f"--mpi: {mpiexec} --version does not look like MPICH, Open MPI or Intel MPI: "
        f"{text.strip()[:200]!r}")


def build_command(flavor: str, mpiexec: str, np: int, hosts: List[HostSlots],
                  env: Dict[str, str], env_names: Sequence[str], mpi_args: Sequence[str],
                  command: Sequence[str], ssh_port: Optional[int] = None,
                  identity_file: Optional[str] = None, output_dir: Optional[str] = None,
                  timestamp: bool = False, python: str = sys.executable,
                  binding_args: Optional[Sequence[str]] = None) -> List[str]:
    """The full mpiexec command line (pure function, for tests and --verbose).

    ``env`` values are set for every rank; ``env_names`` are passed through
    from the launcher's environment by name.  ``command`` runs under the
    output wrapper (started with ``python``), so mpiexec's own output tagging
    stays off.  ``binding_args`` (--binding-args) replace Open MPI's default
    ``--bind-to none --map-by slot``; Hydra binds nothing by default, so there
    they are added.
    """
    host_list = ",".join(f"{h.hostname}:{h.slots}" for h in hosts)
    ssh = None
    if ssh_port or identity_file:
        ssh = "ssh" + (f" -p {int(ssh_port)}" if ssh_port else "") + \
              (f" -i {shlex.quote(identity_file)}" if identity_file else "")
    if flavor == OPENMPI:
        binding = list(binding_args) if binding_args else ["--bind-to", "none",
                                                           "--map-by", "slot"]
        cmd = [mpiexec, "--allow-run-as-root", "-np", str(np), "-H", host_list] + binding
        if ssh:
            cmd += ["-mca", "plm_rsh_args", ssh[len("ssh "):]]
        for k, v in env.items():
            cmd += ["-x", f"{k}={v}"]
        for name in env_names:
            cmd += ["-x", name]
    else:  # Hydra and Intel MPI share the Hydra flags
        cmd = [mpiexec, "-n", str(np), "-hosts", host_list] + list(binding_args or [])
        if ssh:
            cmd += ["-launcher", "ssh", "-launcher-exec", ssh]
        for k, v in env.items():
            cmd += ["-genv", k, v]
        if env_names:
            cmd += ["-genvlist" if flavor == INTEL else "-envlist", ",".join(env_names)]
    return cmd + list(mpi_args) + wrapper_command(command, output_dir, timestamp, python)


def launch_mpi(np: int, hosts: List[HostSlots], command: Sequence[str],
               tunable_env: Dict[str, str], env_names: Sequence[str],
               mpi_args: Sequence[str], ssh_port: Optional[int] = None,
               identity_file: Optional[str] = None, verbose: bool = False,
               output_dir: Optional[str] = None, timestamp: bool = False,
               binding_args: Optional[Sequence[str]] = None,
               hidden_env: Optional[Dict[str, str]] = None) -> int:
    """Run the job under mpiexec; returns its exit code.

    ``output_dir`` (``--output-filename``) is made absolute here: each rank's
    wrapper writes ``output_dir/rank.N/`` on its own host, so for remote hosts
    it must be a shared path.  ``hidden_env`` is set in mpiexec's own environment
    and passed to the ranks by name (its names must be in ``env_names``), so
    secrets never appear on a command line.

    Raises:
        HvdliteConfigError: no mpiexec on PATH, or an unknown flavour.
        HvdliteLaunchError: mpiexec cannot be started.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise HvdliteConfigError("--mpi: no mpiexec/mpirun on PATH (pip install mpich, or "
                                 "use --gloo)")
    flavor = detect_flavor(mpiexec)
    env = dict(tunable_env)
    env[cfg.CPU_OPERATIONS] = "mpi"
    names = [n for n in env_names if n not in env]
    cmd = build_command(flavor, mpiexec, np, hosts, env, names, mpi_args, command,
                        ssh_port, identity_file,
                        output_dir=os.path.abspath(output_dir) if output_dir else None,
                        timestamp=timestamp, binding_args=binding_args)
    if verbose:
        sys.stderr.write(f"hvdlite-run: {flavor}: {' '.join(shlex.quote(c) for c in cmd)}\n")
    try:
        # SIGTERM if we die (even by SIGKILL): mpiexec then ends the ranks it started
        proc = lifeline.popen(cmd, start_new_session=True, death_signal=signal.SIGTERM,
                              env={**os.environ, **hidden_env} if hidden_env else None)
    except OSError as exc:
        raise HvdliteLaunchError(f"--mpi: cannot start {mpiexec}: {exc.strerror}") from None

    def stop_mpiexec():
        try:
            proc.send_signal(signal.SIGINT)
        except OSError:
            pass

    stop_deadline = None
    with StopSignals(stop_mpiexec, action="stopping mpiexec") as sig:
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if sig.stopped.is_set():
                stop_deadline = stop_deadline or time.monotonic() + 5.0
                if time.monotonic() > stop_deadline:
                    kill_tree(psutil.Process(proc.pid), grace_s=3.0)
    if sig.stopped.is_set():
        return 130
    if code != 0:
        sys.stderr.write(f"hvdlite-run: mpiexec ({flavor}) {describe_exit(code)}; see the "
                         f"rank-tagged output above for the failing rank.\n")
        return exit_status(code)
    return 0
