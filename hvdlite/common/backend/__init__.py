"""Transports, one per module behind one interface (``base``): Gloo through
``torch.distributed`` (``gloo``, with its abortable waits in ``gloo_waits``), the host's
shared-memory segment (``shm``), MPI through ``mpi4py`` (``mpi``), and a single process
(``local``).  Only the engine's background thread calls them.  ``torch_store`` is not a
transport: it is torch.distributed's store that the launcher serves, in a process of its
own, for programs that call ``init_process_group()`` (torchrun's variables).

May import ``hvdlite.common.config``, ``exceptions``, ``arrays``, ``engine.message`` and
``net``; never the engine itself or anything above it.
"""
