"""Secrets taken out of ``os.environ`` once read, and kept for the same job only.

Once ``Config.from_env`` has read the job key from ``os.environ`` it is removed from
there, so that the children a training script starts (data-loader workers, shell
commands) do not inherit it, and kept here for later ``init()`` calls in this process
(``shutdown()`` then ``init()``, elastic resets).
"""

import os
from typing import Dict, Optional, Tuple

from hvdlite.common.config.env_names import JOB_ID, RENDEZVOUS_ADDR, RENDEZVOUS_PORT, SECRET_KEY

#: variables that hold a secret
SECRET_VARIABLES = (SECRET_KEY,)
#: the variables naming the job the taken secrets belong to: they are given back only to
#: the same job (a process that is handed another job's variables does not get them)
_JOB_VARIABLES = (JOB_ID, RENDEZVOUS_ADDR, RENDEZVOUS_PORT)
_TAKEN: Dict[str, str] = {}
_TAKEN_FOR: Tuple[Optional[str], ...] = ()


def environ_with_taken_secrets() -> Dict[str, str]:
    """``os.environ`` plus the secrets already taken out of it for the same job (the
    environment wins)."""
    env = dict(os.environ)
    if _TAKEN and tuple(env.get(v) for v in _JOB_VARIABLES) == _TAKEN_FOR:
        for name, value in _TAKEN.items():
            env.setdefault(name, value)
    return env


def take_secrets() -> None:
    """Move the secret variables from ``os.environ`` into this module."""
    global _TAKEN_FOR
    for name in SECRET_VARIABLES:
        value = os.environ.pop(name, None)
        if value:
            _TAKEN[name] = value
            _TAKEN_FOR = tuple(os.environ.get(v) for v in _JOB_VARIABLES)
