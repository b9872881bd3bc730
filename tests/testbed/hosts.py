"""Hosts on one machine, for tests and benchmarks whose traffic must cross a real link.

Each host is a network namespace ``hvdtb<owner pid>-h<i>`` with one interface, ``eth0``,
address ``10.99.0.<i+1>/24`` and name ``tbh<i>`` (a hosts file of its own, which ``ip
netns exec`` mounts over ``/etc/hosts`` for the processes it starts), and its own OpenSSH
server on port 22 of that address.  The hosts' links meet on a bridge in one more
namespace, the switch (``hvdtb<owner pid>-sw``), so nothing is added to the machine's own
network: all traffic stays between addresses of namespaces this module made.

What a link can do (this kernel has no ``netem``, so there is no delay or jitter
emulation; these are what there is):

* :meth:`Testbed.shape` -- a rate limit (``tc tbf``) in both directions of a host's link;
* :meth:`Testbed.lose` -- random loss of a share of the packets arriving at a host
  (``iptables`` statistic match), and :meth:`Testbed.stop_losing`;
* :meth:`Testbed.cut` / :meth:`Testbed.heal` -- the host's switch port down / up;
* :meth:`Testbed.drop_between` / :meth:`Testbed.undrop` -- a partial partition: the
  packets from one host to another dropped (one way, or both), while both still reach
  every other host (``iptables`` in the receiving host's namespace).

Cleaning up: :meth:`Testbed.close` kills every process left in the namespaces (sshd, its
sessions, ranks), deletes the namespaces (their links go with them) and their hosts files.
A testbed whose owner was killed before it could clean up is removed by the next one
(:func:`sweep_stale`: namespaces named after a pid that no longer runs).
"""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence

PREFIX = "hvdtb"
SUBNET = "10.99.0"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
#: how long a host's sshd may take to listen
SSHD_START_S = 15.0
_NAME = re.compile(rf"^{PREFIX}(\d+)-(sw|h\d+)$")


class TestbedUnavailable(RuntimeError):
    """The machine cannot host a testbed (not root, or a tool is missing)."""


def _run(argv: Sequence[str], check: bool = True, timeout_s: float = 30.0) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({proc.returncode}): "
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def check_available() -> None:
    """Raises TestbedUnavailable, saying what is missing."""
    if os.geteuid() != 0:
        raise TestbedUnavailable("the testbed needs root (network namespaces)")
    missing = [t for t in ("ip", "tc", "iptables", "ssh-keygen") if shutil.which(t) is None]
    if not os.path.exists(SSHD):
        missing.append("sshd")
    if missing:
        raise TestbedUnavailable(
            f"the testbed needs {', '.join(missing)} (tests/setup_system.sh installs them)"
        )


def _namespaces() -> List[str]:
    out = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` (twice: a dying sshd may start nothing new), delete it."""
    for sig in (signal.SIGKILL, signal.SIGKILL):
        for pid in _run(["ip", "netns", "pids", ns], check=False).split():
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def sweep_stale() -> List[str]:
    """Remove the namespaces of testbeds whose owner no longer runs; returns their names."""
    stale = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _remove_namespace(ns)
            stale.append(ns)
    return stale


class Host:
    """One namespaced host: its name, address, namespace and sshd."""

    def __init__(self, index: int, owner: int):
        self.index = index
        self.name = f"tbh{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.namespace = f"{PREFIX}{owner}-h{index}"
        self.port_name = f"p{index}"  # its port on the switch
        self.sshd: Optional[subprocess.Popen] = None

    def __repr__(self):
        return f"Host({self.name}, {self.address})"


class Testbed:
    """``n`` hosts on one switch, each with a running sshd; a context manager.

    Raises:
        TestbedUnavailable: not root, or a tool is missing.
    """

    def __init__(self, n: int = 2, workdir: Optional[str] = None):
        check_available()
        sweep_stale()
        self.owner = os.getpid()
        self.dir = workdir or tempfile.mkdtemp(prefix="hvdlite-testbed-")
        self.switch = f"{PREFIX}{self.owner}-sw"
        self.hosts = [Host(i, self.owner) for i in range(n)]
        self.identity = os.path.join(self.dir, "client_key")
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- building ---------------------------------------------------------------------------
    def _build(self) -> None:
        for path in (self.identity, os.path.join(self.dir, "host_key")):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path])
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.hosts
        )
        for h in self.hosts:
            self._add_host(h, hosts_file)
        for h in self.hosts:
            self._start_sshd(h)

    def _add_host(self, h: Host, hosts_file: str) -> None:
        _run(["ip", "netns", "add", h.namespace])
        os.makedirs(f"/etc/netns/{h.namespace}", exist_ok=True)
        with open(f"/etc/netns/{h.namespace}/hosts", "w") as f:
            f.write(hosts_file)
        veth = f"tb{self.owner % 100000}x{h.index}"[:15]
        _run(
            [
                "ip",
                "link",
                "add",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                h.port_name,
                "netns",
                self.switch,
            ]
        )
        _run(["ip", "link", "set", veth, "netns", h.namespace])
        ns = ["ip", "-n", h.namespace]
        _run(ns + ["link", "set", veth, "name", "eth0"])
        _run(ns + ["addr", "add", f"{h.address}/24", "dev", "eth0"])
        _run(ns + ["link", "set", "eth0", "up"])
        _run(ns + ["link", "set", "lo", "up"])
        sw = ["ip", "-n", self.switch]
        _run(sw + ["link", "set", h.port_name, "master", "br0"])
        _run(sw + ["link", "set", h.port_name, "up"])

    def _start_sshd(self, h: Host) -> None:
        auth = os.path.join(self.dir, "authorized_keys")
        if not os.path.exists(auth):
            shutil.copy(self.identity + ".pub", auth)
            os.chmod(auth, 0o600)
        config = os.path.join(self.dir, f"sshd_{h.name}.conf")
        with open(config, "w") as f:
            f.write(
                f"Port 22\nListenAddress {h.address}\n"
                f"HostKey {os.path.join(self.dir, 'host_key')}\n"
                f"AuthorizedKeysFile {auth}\nPidFile {self.dir}/sshd_{h.name}.pid\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
                "StrictModes no\nUsePAM no\nLogLevel ERROR\nMaxStartups 100:30:200\n"
                "MaxSessions 100\n"
            )
        os.makedirs("/run/sshd", exist_ok=True)
        log = open(os.path.join(self.dir, f"sshd_{h.name}.log"), "wb")
        h.sshd = subprocess.Popen(
            ["ip", "netns", "exec", h.namespace, SSHD, "-D", "-e", "-f", config],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + SSHD_START_S
        while not self._listening(h):
            if h.sshd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd on {h.name} did not start: "
                    + open(os.path.join(self.dir, f"sshd_{h.name}.log")).read()
                )
            time.sleep(0.1)

    def _listening(self, h: Host) -> bool:
        out = _run(["ip", "netns", "exec", h.namespace, "ss", "-ltnH"], check=False)
        return f"{h.address}:22 " in out

    # -- using ------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        for h in self.hosts:
            if name in (h.name, h.address):
                return h
        raise KeyError(f"no testbed host {name!r} (hosts: {[h.name for h in self.hosts]})")

    def ssh_args(self) -> List[str]:
        """hvdlite-run's flags to log in to the hosts."""
        return ["-p", "22", "-i", self.identity]

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``argv`` started on ``host`` (inside its namespace)."""
        return subprocess.Popen(["ip", "netns", "exec", self.host(host).namespace, *argv], **kwargs)

    def run(
        self, host: str, argv: Sequence[str], timeout_s: float = 60.0, **kwargs
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.host(host).namespace, *argv], timeout=timeout_s, **kwargs
        )

    def pids(self, host: str) -> List[int]:
        """The processes running on ``host`` (its sshd included)."""
        out = _run(["ip", "netns", "pids", self.host(host).namespace], check=False)
        return [int(p) for p in out.split()]

    def shape(self, host: str, rate: str, burst: str = "256kb") -> None:
        """Limit ``host``'s link to ``rate`` (a tc rate: ``1gbit``, ``100mbit``) both ways."""
        h = self.host(host)
        for ns, dev in ((h.namespace, "eth0"), (self.switch, h.port_name)):
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst,
                    "latency",
                    "100ms",
                ]
            )

    def unshape(self, host: str) -> None:
        h = self.host(host)
        for ns, dev in ((h.namespace, "eth0"), (self.switch, h.port_name)):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    def lose(self, host: str, share: float) -> None:
        """Drop ``share`` (0..1) of the packets arriving at ``host``, at random."""
        h = self.host(host)
        _run(
            [
                "ip",
                "netns",
                "exec",
                h.namespace,
                "iptables",
                "-A",
                "INPUT",
                "-i",
                "eth0",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                f"{share:.4f}",
                "-j",
                "DROP",
            ]
        )

    def stop_losing(self, host: str) -> None:
        _run(["ip", "netns", "exec", self.host(host).namespace, "iptables", "-F", "INPUT"])

    def cut(self, host: str) -> None:
        """Take ``host``'s switch port down: nothing reaches it or leaves it."""
        _run(["ip", "-n", self.switch, "link", "set", self.host(host).port_name, "down"])

    def heal(self, host: str) -> None:
        _run(["ip", "-n", self.switch, "link", "set", self.host(host).port_name, "up"])

    def drop_between(self, a: str, b: str, both_ways: bool = True) -> None:
        """Drop what ``a`` sends to ``b`` (and, ``both_ways``, what ``b`` sends to ``a``);
        both still reach the other hosts."""
        pairs = [(a, b), (b, a)] if both_ways else [(a, b)]
        for src, dst in pairs:
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.host(dst).namespace,
                    "iptables",
                    "-I",
                    "INPUT",
                    "-s",
                    self.host(src).address,
                    "-j",
                    "DROP",
                ]
            )

    def undrop(self, a: str, b: str) -> None:
        """Undo :meth:`drop_between` of ``a`` and ``b`` (either way)."""
        for src, dst in ((a, b), (b, a)):
            _run(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.host(dst).namespace,
                    "iptables",
                    "-D",
                    "INPUT",
                    "-s",
                    self.host(src).address,
                    "-j",
                    "DROP",
                ],
                check=False,
            )

    def describe(self) -> Dict:
        """What a benchmark or a person needs to use the testbed."""
        return {
            "hosts": [
                {"name": h.name, "address": h.address, "namespace": h.namespace} for h in self.hosts
            ],
            "switch": self.switch,
            "ssh_args": self.ssh_args(),
            "dir": self.dir,
        }

    # -- ending -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop everything in the namespaces, delete them; idempotent."""
        if self._closed:
            return
        self._closed = True
        for h in self.hosts:
            if h.sshd is not None and h.sshd.poll() is None:
                h.sshd.kill()
                h.sshd.wait(timeout=10)
        for ns in [h.namespace for h in self.hosts] + [self.switch]:
            if ns in _namespaces():
                _remove_namespace(ns)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Testbed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
