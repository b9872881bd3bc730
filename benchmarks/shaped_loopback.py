"""Run a command with the loopback interface limited to a network link's rate.

One host's ranks talking over TCP (``--no-shared-memory``) stand in for ranks on different
hosts, but loopback moves several GB/s, faster than most links between hosts.  This shapes
``lo`` with a token bucket (``tc qdisc ... tbf``) for the length of the command, then
removes it, so that a benchmark such as ``compression.py`` sees a link of a given rate:

    python benchmarks/shaped_loopback.py --rate 1gbit -- \\
        hvdlite-run -np 2 --no-shared-memory python benchmarks/compression.py

It needs root (CAP_NET_ADMIN) and the ``tc`` tool (Debian's iproute2), and it slows *all*
loopback traffic on the machine while the command runs: run nothing else meanwhile.
"""

import argparse
import shutil
import subprocess
import sys


def tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", required=True, help="link rate in tc's units, e.g. 1gbit, 10gbit")
    p.add_argument("--burst", default="1mb", help="token bucket size (at least lo's MTU)")
    p.add_argument("--latency", default="50ms", help="longest a packet may queue")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run after --")
    if shutil.which("tc") is None:
        p.error("no tc on PATH (apt-get install -y iproute2)")
    tc("qdisc", "replace", "dev", "lo", "root", "tbf", "rate", args.rate,
       "burst", args.burst, "latency", args.latency)
    try:
        return subprocess.run(command).returncode
    finally:
        tc("qdisc", "del", "dev", "lo", "root")


if __name__ == "__main__":
    sys.exit(main())
