"""Log level names in Horovod's spelling and Python's, so that ``HOROVOD_LOG_LEVEL=TRACE``
and ``--log-level fatal`` mean what they mean under horovodrun."""

from hvdlite.common.exceptions import HvdliteConfigError

#: Horovod's log levels as Python's (Horovod has TRACE and FATAL)
_ALIASES = {"TRACE": "DEBUG", "FATAL": "CRITICAL", "WARN": "WARNING"}
_PYTHON_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: every level name accepted, Horovod's included (the launcher's --log-level choices)
LOG_LEVEL_NAMES = ("TRACE",) + _PYTHON_LEVELS[:-1] + ("FATAL", "CRITICAL")


def log_level_name(level: str) -> str:
    """Python's name of a log level given in Horovod's or Python's spelling, any case.

    Raises:
        HvdliteConfigError: not a level name (the message lists them).
    """
    name = str(level).strip().upper()
    name = _ALIASES.get(name, name)
    if name not in _PYTHON_LEVELS:
        raise HvdliteConfigError(f"log level {level!r} is not one of {', '.join(LOG_LEVEL_NAMES)}")
    return name
