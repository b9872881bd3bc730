"""Fixtures shared by every test folder: a real sshd on a spare loopback port, and the
removal of the flight-recorder dumps the suite's failed jobs leave."""

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
#: where a failed job's ranks write their flight-recorder dumps by default
FLIGHT_DUMPS = os.path.join(tempfile.gettempdir(), "hvdlite-flight-*")


@pytest.fixture(scope="session", autouse=True)
def remove_flight_dumps():
    """The suite fails many jobs on purpose; each leaves its flight-recorder dumps in a
    directory of its own (kept for the user to diagnose): remove the ones this session made."""
    before = set(glob.glob(FLIGHT_DUMPS))
    yield
    for path in set(glob.glob(FLIGHT_DUMPS)) - before:
        shutil.rmtree(path, ignore_errors=True)


def summary_names(text: str, rank: int, error: str, host=None) -> bool:
    """Does a failure-summary line of ``text`` name ``rank`` (on ``host``; any when None)
    with ``error`` as what it died of?  The summary says "exited with code C: ERROR", or
    "failed first: ERROR" when a peer's exit reached the launcher before it."""
    where = re.escape(host) if host is not None else r"\S+"
    pattern = re.compile(
        rf"rank {rank} on host {where} (?:exited with code \d+|failed first): " + re.escape(error)
    )
    return any(pattern.search(line) for line in text.splitlines())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sshd:
    def __init__(self, port, identity, wrong_identity, known_hosts, proc):
        self.port = port
        self.identity = identity
        self.wrong_identity = wrong_identity
        self.known_hosts = known_hosts
        self.proc = proc

    def ssh_args(self):
        return ["-p", str(self.port), "-i", self.identity]


def _keygen(path, kind="ed25519"):
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", path], check=True)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 and 127.0.0.2 at a spare port."""
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        pytest.skip("openssh-server is not installed (run tests/setup_system.sh as root)")
    if os.geteuid() != 0:
        pytest.skip("the sshd fixture needs root (it logs in as the current user via root sshd)")
    d = tmp_path_factory.mktemp("sshd")
    host_key, client_key, wrong_key = (str(d / n) for n in ("host_key", "client_key", "wrong_key"))
    for k in (host_key, client_key, wrong_key):
        _keygen(k)
    auth = d / "authorized_keys"
    auth.write_text(open(client_key + ".pub").read())
    os.chmod(auth, 0o600)
    port = free_port()
    config = d / "sshd_config"
    config.write_text(f"""Port {port}
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey {host_key}
AuthorizedKeysFile {auth}
PidFile {d}/sshd.pid
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
LogLevel ERROR
MaxStartups 100:30:200
MaxSessions 100
""")
    os.makedirs("/run/sshd", exist_ok=True)
    log = open(d / "sshd.log", "wb")
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log, start_new_session=True
    )
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.2", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"sshd did not start: {(d / 'sshd.log').read_text()}")
            time.sleep(0.1)
    pub = open(host_key + ".pub").read().split()
    known = d / "known_hosts"
    known.write_text(f"[127.0.0.2]:{port} {pub[0]} {pub[1]}\n")
    yield Sshd(port, client_key, wrong_key, str(known), proc)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)
    log.close()
