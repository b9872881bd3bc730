"""hvdlite for PyTorch: the horovod.torch API (``import hvdlite.torch as hvd``)."""

from hvdlite.common.exceptions import (HostsUpdatedInterrupt, HvdliteError,  # noqa: F401
                                       HvdliteInternalError)
from hvdlite.torch.mpi_ops import *  # noqa: F401,F403
from hvdlite.torch.mpi_ops import __all__ as _ops_all

#: the name Horovod users catch in elastic training loops
HorovodInternalError = HvdliteInternalError

__all__ = list(_ops_all) + ["HvdliteError", "HvdliteInternalError", "HorovodInternalError",
                            "HostsUpdatedInterrupt"]
