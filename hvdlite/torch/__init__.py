"""hvdlite for PyTorch: the horovod.torch API (``import hvdlite.torch as hvd``)."""

from hvdlite.common.exceptions import (
    HostsUpdatedInterrupt,
    HvdliteError,  # noqa: F401
    HvdliteInternalError,
)
from hvdlite.torch.mpi_ops import *  # noqa: F401,F403
from hvdlite.torch.mpi_ops import __all__ as _ops_all
from hvdlite.torch.compression import Compression  # noqa: F401
from hvdlite.torch.functions import (
    allgather_object,
    broadcast_object,  # noqa: F401
    broadcast_optimizer_state,
    broadcast_parameters,
)
from hvdlite.torch.optimizer import DistributedOptimizer  # noqa: F401
from hvdlite.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from hvdlite.torch.slow_links.diloco import DiLoCo  # noqa: F401
from hvdlite.torch import elastic  # noqa: F401,E402
from hvdlite.common.basics import start_timeline, stop_timeline  # noqa: F401,E402

#: the name Horovod users catch in elastic training loops
HorovodInternalError = HvdliteInternalError

__all__ = list(_ops_all) + [
    "HvdliteError",
    "HvdliteInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "elastic",
    "start_timeline",
    "stop_timeline",
    "Compression",
    "DistributedOptimizer",
    "SyncBatchNorm",
    "DiLoCo",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
]
