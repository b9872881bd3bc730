"""Under plain mpiexec (no job key), broadcast_object must refuse rather than unpickle."""

import hvdlite.torch as hvd
from hvdlite.common.exceptions import HvdliteAuthError

hvd.init()
try:
    hvd.broadcast_object({"x": 1}, root_rank=0)
    print(f"UNPICKLED rank={hvd.rank()}", flush=True)
except HvdliteAuthError as exc:
    print(f"REFUSED rank={hvd.rank()} {exc}", flush=True)
hvd.shutdown()
