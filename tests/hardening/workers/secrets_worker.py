"""What a rank holds of the job's secrets: the key leaves os.environ at init() (children
do not inherit it), object collectives are signed, re-init still works; ``-x`` values
arrive.  Prints one ``SECRETS ...`` line per rank."""

import os
import subprocess
import sys

import hvdlite.torch as hvd
from hvdlite.common import config as cfg

before = cfg.SECRET_KEY in os.environ
hvd.init()
got = hvd.broadcast_object({"from": hvd.rank()}, root_rank=0)
child = subprocess.run(
    [sys.executable, "-c", f"import os; print({cfg.SECRET_KEY!r} in os.environ)"],
    capture_output=True,
    text=True,
    timeout=60,
).stdout.strip()
print(
    f"SECRETS rank={hvd.rank()} before={before} after={cfg.SECRET_KEY in os.environ} "
    f"child={child} obj={got['from']} x={os.environ.get('SECRET_X')}",
    flush=True,
)
hvd.shutdown()
hvd.init()  # re-init after the key left the environment
print(f"REINIT rank={hvd.rank()} {hvd.allgather_object(hvd.rank())}", flush=True)
hvd.shutdown()
