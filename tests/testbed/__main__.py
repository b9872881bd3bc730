"""``python -m tests.testbed up [--hosts N] [--rate RATE]``: build a testbed, print what it
is as JSON, keep it until SIGINT/SIGTERM, then remove it.  ``python -m tests.testbed
sweep``: remove the testbeds whose owner died.  Needs root."""

import argparse
import json
import signal
import sys
import threading

from tests.testbed.hosts import Testbed, TestbedUnavailable, sweep_stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a testbed and keep it until interrupted")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", help="shape every host's link (a tc rate, e.g. 1gbit)")
    sub.add_parser("sweep", help="remove testbeds whose owner no longer runs")
    args = parser.parse_args(argv)
    if args.cmd == "sweep":
        print("\n".join(sweep_stale()) or "nothing stale")
        return 0
    try:
        tb = Testbed(args.hosts)
    except TestbedUnavailable as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.rate:
            for h in tb.hosts:
                tb.shape(h.name, args.rate)
        print(json.dumps(tb.describe()), flush=True)
        stop.wait()
    finally:
        tb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
