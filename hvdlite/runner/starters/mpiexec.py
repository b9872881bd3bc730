"""The mpiexec starter: MPI mode, one ``mpiexec`` for the whole job.

The flavour is detected from ``mpiexec --version``: MPICH's Hydra, Open MPI,
or Intel MPI (Hydra-based, ``-genv`` too).  Each gets its own flags for
hosts/slots and environment.  Rank identity comes from MPI itself; the launcher
only passes the tunables and ``HVDLITE_CPU_OPERATIONS=mpi``.

Output is tagged as in Gloo mode, ``[rank]<stdout>:`` / ``[rank]<stderr>:`` with
whole lines, not by mpiexec: every rank runs under the small wrapper of
:mod:`hvdlite.runner.processes.rank_output`, which also writes ``--output-filename``'s
``DIR/rank.N/stdout|stderr`` files (on the rank's host).

There is no rendezvous store under ``--mpi``, so this starter serves a
:class:`ReportStore` for what the ranks report: stacks (``stack_report``,
``stacks_wanted``), ``metrics`` and ``straggler`` lines, and exit reports
(``exit_report``).  It
listens on 127.0.0.1 for a local job, else on this host's address towards the first
remote host, and its address reaches the ranks as the rendezvous variables; the job
key reaches them by name through mpiexec's environment, never on a command line.
Every rank starts as local slot 0 here, so its exit report carries its MPI rank; a
failure summary names the first rank whose own exception came first ("rank R on host
H failed first: ...; mpiexec (flavour) then exited ... and ended the other ranks"),
else gives mpiexec's exit and points at the rank-tagged output.
"""

import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import psutil

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteLaunchError
from hvdlite.runner.processes import lifeline
from hvdlite.runner.hosts import HostSlots, SlotInfo, is_local, resolve
from hvdlite.runner.processes.workers import describe_exit, kill_tree
from hvdlite.runner.processes.rank_output import wrapper_command
from hvdlite.runner.store.exit_reports import ExitReports
from hvdlite.runner.store.stack_collection import Handler, ReportStore
from hvdlite.runner.hosts import SlotId, slot_id
from hvdlite.runner.starters.base import Starter

log = logging.getLogger(__name__)

HYDRA, OPENMPI, INTEL = "mpich-hydra", "openmpi", "intel-mpi"
#: how long mpiexec gets to end its ranks after SIGINT before the whole tree is killed
STOP_GRACE_S = 5.0


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
                  binding_args: Optional[Sequence[str]] = None,
                  ssh_wrapper: Optional[str] = None) -> List[str]:
    """The full mpiexec command line (pure function, for tests and --verbose).

    ``env`` values are set for every rank; ``env_names`` are passed through
    from the launcher's environment by name.  ``command`` runs under the
    output wrapper (started with ``python``), so mpiexec's own output tagging
    stays off.  ``binding_args`` (--binding-args) replace Open MPI's default
    ``--bind-to none --map-by slot``; Hydra binds nothing by default, so there
    they are added.  ``ssh_wrapper``: Hydra's ``-launcher-exec`` takes one program,
    not a command line, so ``-p``/``-i`` reach it as a script that adds them
    (:func:`write_ssh_wrapper`); needed on Hydra when ``ssh_port``/``identity_file``
    is given.

    Raises:
        HvdliteLaunchError: Hydra with an SSH port or key, but no ``ssh_wrapper``.
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
            if ssh_wrapper is None:
                raise HvdliteLaunchError(
                    f"--mpi ({flavor}): -p/-i need an ssh wrapper for -launcher-exec")
            cmd += ["-launcher", "ssh", "-launcher-exec", ssh_wrapper]
        for k, v in env.items():
            cmd += ["-genv", k, v]
        if env_names:
            cmd += ["-genvlist" if flavor == INTEL else "-envlist", ",".join(env_names)]
    return cmd + list(mpi_args) + wrapper_command(command, output_dir, timestamp, python)


def write_ssh_wrapper(directory: str, ssh_port: Optional[int],
                      identity_file: Optional[str]) -> str:
    """A script ``ssh -p PORT -i KEY "$@"`` in ``directory``, for Hydra's -launcher-exec.

    Hydra runs ``-launcher-exec`` as one program name (given "ssh -p 2222" it fails
    with "execvp error on file ssh -p 2222") and has no option for the port or the
    key, so they are put in a script.  The directory is the caller's private one
    (0700); the script is 0700 too.  The key path is quoted for the shell.
    """
    args = ["ssh"]
    if ssh_port:
        args += ["-p", str(int(ssh_port))]
    if identity_file:
        args += ["-i", os.path.abspath(identity_file)]
    path = os.path.join(directory, "hvdlite-ssh")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write("#!/bin/sh\n# hvdlite-run --mpi: ssh with -p/-i for Hydra's -launcher-exec\n"
                f"exec {' '.join(shlex.quote(a) for a in args)} \"$@\"\n")
    return path


class MpiexecStarter(Starter):
    """One ``mpiexec`` runs the whole (static) job: it places, starts and ends the ranks.

    mpiexec is its own process manager, so this starter sees one process: :meth:`start`
    is called once with every slot, and when mpiexec exits every slot reports its code.
    ``env`` travels on mpiexec's command line (tunables only); ``hidden_env`` is set in
    mpiexec's own environment and passed to the ranks by name (its names must be in
    ``env_names``), so secrets never appear on a command line.  ``output_dir``
    (``--output-filename``) is made absolute: each rank's wrapper writes
    ``output_dir/rank.N/`` on its own host, so for remote hosts it must be a shared path.
    """

    needs_rendezvous = False
    stop_action = "stopping mpiexec"

    def __init__(self, hosts: List[HostSlots], command: Sequence[str], env: Dict[str, str],
                 env_names: Sequence[str], mpi_args: Sequence[str],
                 ssh_port: Optional[int] = None, identity_file: Optional[str] = None,
                 verbose: bool = False, output_dir: Optional[str] = None,
                 timestamp: bool = False, binding_args: Optional[Sequence[str]] = None,
                 hidden_env: Optional[Dict[str, str]] = None,
                 on_exit: Callable[[], None] = lambda: None,
                 reports: Optional[Tuple[bytes, Dict[str, Handler]]] = None):
        """``reports``: (job key, store ops): a :class:`ReportStore` serves them, and the
        ranks' exit reports, to the ranks; its address is passed as the rendezvous
        variables.

        Raises:
            HvdliteConfigError: no mpiexec on PATH, or an unknown flavour.
        """
        self._mpiexec = find_mpiexec()
        if self._mpiexec is None:
            raise HvdliteConfigError("--mpi: no mpiexec/mpirun on PATH (pip install mpich, "
                                     "or use --gloo)")
        self.flavor = detect_flavor(self._mpiexec)
        self._hosts = list(hosts)
        self._command = list(command)
        self._env = dict(env)         # the tunables, HVDLITE_CPU_OPERATIONS=mpi among them
        self._names = [n for n in env_names if n not in self._env]
        self._mpi_args = list(mpi_args)
        self._ssh = (ssh_port, identity_file)
        self._wrapper_dir: Optional[str] = None
        self._verbose = verbose
        self._output = (os.path.abspath(output_dir) if output_dir else None, timestamp)
        self._binding_args = binding_args
        self._hidden_env = hidden_env
        self._on_exit = on_exit
        self._proc: Optional[subprocess.Popen] = None
        self._slots: List[SlotInfo] = []
        self._reported = False
        self._reports = reports
        self._store: Optional[ReportStore] = None
        #: the ranks' exit reports, so a failure names the rank that raised first
        self._exit_reports = ExitReports()

    def _start_report_store(self, hosts: List[HostSlots]) -> None:
        """The store the ranks send reports to, on an address every host reaches."""
        if self._reports is None or self._store is not None:
            return
        remote = [h.hostname for h in hosts if not is_local(h.hostname)]
        addr = _address_towards(resolve(remote[0])) if remote else "127.0.0.1"
        self._store = ReportStore(self._reports[0],
                                  {**self._reports[1], **self._exit_reports.ops()},
                                  bind_addr=addr, expected_peers=sum(h.slots for h in hosts))
        self._env[cfg.RENDEZVOUS_ADDR] = self._store.address[0]
        self._env[cfg.RENDEZVOUS_PORT] = str(self._store.address[1])

    def _wrapper(self) -> Optional[str]:
        """Hydra with -p/-i: the ssh wrapper script, in a private directory of ours."""
        if self.flavor == OPENMPI or not any(self._ssh):
            return None
        self._wrapper_dir = tempfile.mkdtemp(prefix="hvdlite-mpi-ssh-")
        return write_ssh_wrapper(self._wrapper_dir, *self._ssh)

    def close(self) -> None:
        if self._store is not None:
            self._store.shutdown()
        if self._wrapper_dir is not None:
            shutil.rmtree(self._wrapper_dir, ignore_errors=True)
            self._wrapper_dir = None

    def start(self, slots: Sequence[SlotInfo]) -> Dict[SlotId, str]:
        if self._proc is not None:
            raise HvdliteLaunchError("--mpi: an MPI world cannot grow; mpiexec already runs")
        used = [h for h in self._hosts if any(s.hostname == h.hostname for s in slots)]
        self._start_report_store(used)
        cmd = build_command(self.flavor, self._mpiexec, len(slots), used, self._env,
                            self._names, self._mpi_args, self._command, *self._ssh,
                            output_dir=self._output[0], timestamp=self._output[1],
                            binding_args=self._binding_args, ssh_wrapper=self._wrapper())
        if self._verbose:
            sys.stderr.write(f"hvdlite-run: {self.flavor}: "
                             f"{' '.join(shlex.quote(c) for c in cmd)}\n")
        env = {**os.environ, **self._hidden_env} if self._hidden_env else None
        try:
            # SIGTERM if we die (even by SIGKILL): mpiexec then ends the ranks it started
            self._proc = lifeline.popen(cmd, start_new_session=True,
                                        death_signal=signal.SIGTERM, env=env)
        except OSError as exc:
            return {slot_id(s): f"--mpi: cannot start {self._mpiexec}: {exc.strerror}"
                    for s in slots}
        self._slots = list(slots)
        threading.Thread(target=self._watch, name="mpiexec-watch", daemon=True).start()
        return {}

    def _watch(self) -> None:
        self._proc.wait()
        self._on_exit()

    def poll(self) -> List[Tuple[SlotId, int]]:
        if self._proc is None or self._reported or self._proc.poll() is None:
            return []
        self._reported = True
        return [(slot_id(s), self._proc.returncode) for s in self._slots]

    def stop(self, ids: Sequence[SlotId]) -> None:
        self._interrupt()

    def _interrupt(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.send_signal(signal.SIGINT)
            except OSError:
                pass

    def stop_all(self) -> None:
        """SIGINT (mpiexec then ends its ranks), and after a grace period the whole tree."""
        if self._proc is None or self._proc.poll() is not None:
            return
        self._interrupt()
        try:
            self._proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                kill_tree(psutil.Process(self._proc.pid), grace_s=3.0)
            except psutil.NoSuchProcess:
                pass

    def describe_failure(self, sid: SlotId, code: int) -> Optional[str]:
        """Names the rank whose exception came first (its exit report), not a peer that
        only saw it leave; else points at the rank-tagged output."""
        cause = self._exit_reports.cause()
        if cause is None:
            return (f"hvdlite-run: mpiexec ({self.flavor}) {describe_exit(code)}; see the "
                    f"rank-tagged output above for the failing rank.\n")
        (host, slot), report = cause
        who = f"local rank {slot}" if report["rank"] is None else f"rank {report['rank']}"
        return (f"hvdlite-run: {who} on host {host} failed first: {report['error']}; "
                f"mpiexec ({self.flavor}) then {describe_exit(code)} and ended the other "
                f"ranks.\n")


def _address_towards(peer: str) -> str:
    """This host's address on the route to ``peer`` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((peer, 9))
        return sock.getsockname()[0]
