"""Transports, one per module behind one interface (``base``): Gloo through
``torch.distributed`` (``gloo``, with its abortable waits in ``gloo_waits``), the host's
shared-memory segment (``shm``), MPI through ``mpi4py`` (``mpi``), and a single process
(``local``).  Only the engine's background thread calls them.

May import ``hvdlite.common.config``, ``exceptions``, ``arrays``, ``engine.message`` and
``net``; never the engine itself or anything above it.
"""
