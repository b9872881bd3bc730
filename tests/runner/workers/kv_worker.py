"""Plain-Python worker: checks its identity env and rendezvouses through KVClient.

Args: [--fail-rank R --code C] [--sleep S] [--tag TAG]
Each rank sets rank/<r> = hostname, reads every other rank's key, and prints
one line 'OK rank=.. size=.. local=../.. cross=../.. host=.. peers=..'.
"""

import argparse
import os
import sys
import time

from hvdlite.common import config as cfg
from hvdlite.common.net.kv import KVClient

p = argparse.ArgumentParser()
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--code", type=int, default=3)
p.add_argument("--sleep", type=float, default=0)
p.add_argument("--tag", default="")
p.add_argument("--print-env", default="")
a = p.parse_args()

env = os.environ
rank, size = int(env[cfg.RANK]), int(env[cfg.SIZE])
assert env["HOROVOD_RANK"] == str(rank) and env["HOROVOD_SIZE"] == str(size)
store = KVClient(
    (env[cfg.RENDEZVOUS_ADDR], int(env[cfg.RENDEZVOUS_PORT])),
    bytes.fromhex(env[cfg.SECRET_KEY]),
    timeout_s=30,
    prefix=env[cfg.JOB_ID] + "/",
)
store.set(f"rank/{rank}", env[cfg.HOSTNAME].encode())
peers = [store.get(f"rank/{r}").decode() for r in range(size)]
store.add("arrived", 1)
store.wait(["arrived"])
for name in filter(None, a.print_env.split(",")):
    print(f"ENV {name}={env.get(name, '<unset>')}", flush=True)
print(
    f"OK rank={rank} size={size} local={env[cfg.LOCAL_RANK]}/{env[cfg.LOCAL_SIZE]} "
    f"cross={env[cfg.CROSS_RANK]}/{env[cfg.CROSS_SIZE]} host={env[cfg.HOSTNAME]} "
    f"iface={env.get(cfg.GLOO_IFACE, '')} rdv={env[cfg.RENDEZVOUS_ADDR]} "
    f"peers={','.join(peers)}",
    flush=True,
)
print(f"to stderr from {rank}", file=sys.stderr, flush=True)
if rank == a.fail_rank:
    time.sleep(0.5)
    sys.exit(a.code)
if a.sleep:
    print(f"READY {rank}", flush=True)
    time.sleep(a.sleep)
