"""Worker processes on this host: starting them with their rank's environment, tying
their life to ours (``lifeline``), prefixing or capturing their output
(``rank_output``), ending process trees and describing exits (``workers``).

May import ``hvdlite.runner.hosts`` and ``hvdlite.common``.
"""
