"""hvdlite for TensorFlow 2: the horovod.tensorflow API (``import hvdlite.tensorflow as hvd``).

It runs on the same runtime as ``hvdlite.torch`` (background thread, negotiation, fusion,
process sets).  torch is optional: with it, the runtime's buffers are torch tensors and
Gloo (torch.distributed's transport) is available; without it, run on MPI
(``hvdlite-run --mpi``) and the buffers are numpy arrays.  A process uses one framework at a
time.
"""

from hvdlite.common.exceptions import (
    HostsUpdatedInterrupt,
    HvdliteError,  # noqa: F401
    HvdliteInternalError,
)
from hvdlite.tensorflow.mpi_ops import *  # noqa: F401,F403
from hvdlite.tensorflow.mpi_ops import __all__ as _ops_all
from hvdlite.tensorflow.compression import Compression  # noqa: F401
from hvdlite.tensorflow.functions import (
    allgather_object,
    broadcast_,  # noqa: F401
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from hvdlite.tensorflow.gradient_tape import (
    DistributedGradientTape,  # noqa: F401
    PartialDistributedGradientTape,
)
from hvdlite.tensorflow.info_ops import (
    local_rank_op,
    local_size_op,  # noqa: F401
    process_set_included_op,
    rank_op,
    size_op,
)
from hvdlite.tensorflow.tf1 import (
    BroadcastGlobalVariablesHook,  # noqa: F401
    DistributedOptimizer,
    broadcast_global_variables,
)
from hvdlite.tensorflow import elastic  # noqa: F401,E402

#: the name Horovod users catch in elastic training loops
HorovodInternalError = HvdliteInternalError

__all__ = list(_ops_all) + [
    "HvdliteError",
    "HvdliteInternalError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "elastic",
    "Compression",
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "broadcast_variables",
    "broadcast_",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
    "rank_op",
    "size_op",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "SyncBatchNormalization",  # noqa: F405  (loaded on first use: __getattr__)
    "DistributedOptimizer",
    "broadcast_global_variables",  # noqa: F405
    "BroadcastGlobalVariablesHook",
]


def __getattr__(name):
    """``SyncBatchNormalization`` loads Keras on first use: ``import hvdlite.tensorflow``
    alone does not pay for Keras's import."""
    if name == "SyncBatchNormalization":
        from hvdlite.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
