"""A real one-node Slurm (munged, slurmctld, slurmd of Debian's slurm-wlm) for the tests.

Everything lives in one folder: the generated ``slurm.conf``, the state and spool dirs,
the logs and munge's socket; the daemons run in the foreground as our children (each in
its own session) on spare ports, and :meth:`Cluster.stop` ends them by pid.  Commands
reach this cluster through ``SLURM_CONF`` (:meth:`Cluster.env`).
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List

from tests.conftest import free_port

SBIN = ("/usr/sbin", "/usr/bin")
START_TIMEOUT_S = 30.0


def _which(name: str) -> str:
    return shutil.which(name) or next(
        (os.path.join(d, name) for d in SBIN if os.path.exists(os.path.join(d, name))), ""
    )


def missing() -> List[str]:
    """The Slurm and munge programs that are not installed."""
    return [
        n for n in ("munged", "slurmctld", "slurmd", "srun", "salloc", "sinfo") if not _which(n)
    ]


class Cluster:
    """One node, named as this machine, with ``cpus`` CPUs."""

    def __init__(self, root: str):
        self.root = root
        self.node = socket.gethostname().split(".")[0]
        # nproc's count; at least 2 (the tests run 2 tasks), which config_overrides allows
        self.cpus = max(2, len(os.sched_getaffinity(0)))
        self.conf = os.path.join(root, "slurm.conf")
        self.procs: List[subprocess.Popen] = []

    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = self.conf
        return env

    def _write_conf(self) -> None:
        r = self.root
        for d in ("ctld", "spool", "munge"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        os.chmod(os.path.join(r, "munge"), 0o700)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=hvdlite
FirstJobId={random.randint(1, 10**6)}
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.sock
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _daemon(self, args: List[str], log: str) -> None:
        out = open(os.path.join(self.root, log), "ab")
        self.procs.append(
            subprocess.Popen(args, stdout=out, stderr=out, env=self.env(), start_new_session=True)
        )
        out.close()

    def start(self) -> None:
        """Start munged, slurmctld and slurmd; wait until the node is idle.

        Raises:
            RuntimeError: a daemon exited, or the node was not idle in time (with the logs).
        """
        self._write_conf()
        r = self.root
        self._daemon(
            [
                _which("munged"),
                "-F",
                "--force",
                f"--socket={r}/munge/munge.sock",
                f"--pid-file={r}/munge/munged.pid",
                f"--log-file={r}/munged.log",
                f"--seed-file={r}/munge/seed",
            ],
            "munged.out",
        )
        self._wait_for(lambda: os.path.exists(f"{r}/munge/munge.sock"), "munged")
        self._daemon([_which("slurmctld"), "-D", "-i", "-f", self.conf], "slurmctld.out")
        self._daemon([_which("slurmd"), "-D", "-f", self.conf, "-N", self.node], "slurmd.out")
        self._wait_for(self._idle, "the node to be idle in sinfo")

    def _idle(self) -> bool:
        out = subprocess.run(
            [_which("sinfo"), "-h", "-o", "%t"],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return "idle" in out

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"Slurm test cluster: waiting for {what} failed (exited: {dead})\n{self.logs()}"
                )
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.root, name), errors="replace") as f:
                    parts.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """End the daemons (by pid, each its own process group), newest first."""
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        self.procs = []
