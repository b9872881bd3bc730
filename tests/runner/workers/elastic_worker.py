"""Plain-Python elastic worker: joins rendezvous rounds through KVClient, no framework.

Args: [--fail SLOT --code C [--fail-once MARKER]] [--done-file F] [--done-after N] [--tag TAG]
Each round it joins, it prints 'JOINED round=.. rank=.. size=.. slot=host:local'.
The worker whose slot (host:local) is --fail exits with --code after joining its
first round (with --fail-once: only while MARKER does not exist; it creates it).
The others keep joining newer rounds until --done-file exists or they joined round
--done-after (then exit 0), or the newest round has no place for them (exit 0: stale).
"""

import argparse
import os
import sys
import time

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteRemovedError, HvdliteTimeoutError
from hvdlite.common.net.kv import KVClient

p = argparse.ArgumentParser()
p.add_argument("--fail", default="")
p.add_argument("--code", type=int, default=3)
p.add_argument("--fail-once", default="")
p.add_argument("--done-file", default="")
p.add_argument("--done-after", type=int, default=-1)
p.add_argument("--tag", default="")
a = p.parse_args()

env = os.environ
assert env[cfg.ELASTIC] == "1"
host, local = env[cfg.HOSTNAME], int(env[cfg.LOCAL_RANK])
me = f"{host}:{local}"
print(f"ENV slot={me} elastic_timeout={env.get(cfg.ELASTIC_TIMEOUT)}", flush=True)
store = KVClient(
    (env[cfg.RENDEZVOUS_ADDR], int(env[cfg.RENDEZVOUS_PORT])),
    bytes.fromhex(env[cfg.SECRET_KEY]),
    timeout_s=30,
)
last = -1
while True:
    if a.done_file and os.path.exists(a.done_file):
        print(f"DONE slot={me}", flush=True)
        sys.exit(0)
    # like a real rank, ask for the next round only once it is open (a rank asks while
    # still in its round only when that round failed: when all do, the agent reopens it)
    if last >= 0 and store.await_round(last, 0.3) <= last:
        continue
    try:
        place = store.join_round(last, host, local, timeout_s=0.3)
    except HvdliteRemovedError:
        print(f"STALE slot={me}", flush=True)
        sys.exit(0)
    except HvdliteTimeoutError:
        continue
    last = place.round
    print(
        f"JOINED round={place.round} rank={place.rank} size={place.size} slot={me} "
        f"local={place.local_rank}/{place.local_size} cross={place.cross_rank}/"
        f"{place.cross_size}",
        flush=True,
    )
    if me == a.fail and not (a.fail_once and os.path.exists(a.fail_once)):
        if a.fail_once:
            open(a.fail_once, "w").close()
        time.sleep(0.3)
        sys.exit(a.code)
    if 0 <= a.done_after <= place.round:
        print(f"DONE slot={me}", flush=True)
        sys.exit(0)
