"""Worker processes on this host: starting them with their rank's environment, tying
their life to ours (``lifeline``), prefixing or capturing their output
(``rank_output``), ending process trees and describing exits (``workers``), reading
their Python stacks from outside with py-spy (``py_spy``).

The lowest layer of the launcher: besides its own modules it may import only
``hvdlite.common``, never ``hvdlite.runner.hosts`` or the other launcher packages above it.
"""
