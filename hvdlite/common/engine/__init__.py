"""The engine: the background thread that turns enqueued tensors into collectives.

Owns the runtime loop (``runtime``), the queue user threads enqueue into
(``tensor_queue``), the negotiation of what is ready on every rank (``controller``,
``message``, ``control_vector``, ``response_cache``), the fusion plan and its
execution over a backend (``fusion``, ``executor``, ``adasum``) and the live
parameters that rank 0 tunes (``parameters``, ``autotune``).

May import: ``hvdlite.common.config``, ``exceptions``, ``arrays``, ``net``,
``backend`` and ``diagnostics``.  Nothing above it (the op layer, frameworks,
the launcher).
"""
