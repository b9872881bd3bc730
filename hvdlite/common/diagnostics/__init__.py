"""What a rank records about itself for the user: flight recorder, stacks, stragglers,
metric counters, the timeline writer, and the exit report it sends the launcher.

``recorder`` is the one interface the engine calls; ``observers`` combines the
recorders a job turned on.  May import ``hvdlite.common.config``, ``exceptions``,
``net`` and the other modules here; never the engine, the op layer or above.
"""
