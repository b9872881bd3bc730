"""``hvdlite-run``'s command line: flags, ``--config-file`` YAML and their checks, turned
into one launch configuration and handed to the agent (``launch.main``).

The top of the launcher: may import every other ``hvdlite.runner`` package.
"""
