"""The backend of a 1-rank job (a script run without the launcher)."""

from hvdlite.common import arrays
from hvdlite.common.backend.base import Backend


class LocalBackend(Backend):
    """Every collective over one rank returns its input."""

    name = "local"

    def __init__(self, config):
        self.rank, self.size = 0, 1
        self.local_rank, self.local_size = 0, 1
        self.cross_rank, self.cross_size = 0, 1

    def control_allreduce_min(self, vec):
        return vec

    def _allgather_fixed(self, buf):
        return buf

    def allreduce_(self, tensor, op):
        pass

    def allgather_bytes(self, send, counts):
        return [send]

    def broadcast_(self, tensor, root):
        pass

    def alltoall_bytes(self, send, send_counts, recv_counts):
        return arrays.kind().clone(send)

    def sendrecv_(self, send, recv, peer):
        """The only peer is this rank itself: what is sent comes back."""
        if peer != 0:
            raise ValueError(f"sendrecv_ with rank {peer} in a 1-rank job")
        arrays.kind().copy_(recv, send)
