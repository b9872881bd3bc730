"""The one exception tree of hvdlite.

Every error a user can see derives from :class:`HvdliteError`, so
``except HvdliteError`` catches all of them.  Errors raised by a collective
(ranks disagree, a peer failed) are ``RuntimeError``s, as Horovod's are; bad
settings and a name already in flight are ``ValueError``s (Horovod reports the
latter as an invalid argument); invalid arguments found locally raise the
builtin ``ValueError``/``TypeError`` directly.
"""


class HvdliteError(Exception):
    """Base of every hvdlite error."""


class HvdliteConfigError(HvdliteError, ValueError):
    """A setting (environment variable or launcher flag) has a bad value."""


class HvdliteNotInitializedError(HvdliteError, ValueError):
    """An API call that needs ``init()`` was made before it (or after ``shutdown()``)."""


class HvdliteInternalError(HvdliteError, RuntimeError):
    """The runtime cannot complete an operation: a peer died or shut down,
    the transport failed, or the background thread stopped.

    Horovod raises ``HorovodInternalError`` in the same situations; elastic
    training catches it to reset.
    """


class HvdliteTimeoutError(HvdliteInternalError, TimeoutError):
    """A bounded wait ran out; the message names the stage and the knob."""


class HvdliteMismatchError(HvdliteError, RuntimeError):
    """Ranks submitted the same tensor name with incompatible parameters."""


class HvdliteDuplicateNameError(HvdliteError, ValueError):
    """A tensor name was submitted again while the first one is still in flight (a
    ``ValueError``, as Horovod's invalid-argument error for it is)."""


class HvdliteStallError(HvdliteInternalError):
    """Some ranks submitted a tensor that others never did, past the stall shutdown time."""


class HvdliteSerializationError(HvdliteError, RuntimeError):
    """An object collective could not pickle some rank's object; raised on every rank."""


class HvdliteAuthError(HvdliteError):
    """A control-plane message failed authentication (bad or missing HMAC, replay)."""


class HvdliteLaunchError(HvdliteError):
    """The launcher could not start or keep running the job: a host, task or worker
    failed; the message names the host or rank."""


class HvdliteRemovedError(HvdliteError):
    """Elastic mode: this process has no place in the newest rendezvous round (its host or
    slot was removed, or it is a stale process); ``hvd.elastic.run`` exits it cleanly."""


class HostsUpdatedInterrupt(HvdliteError):
    """Elastic mode: the job's hosts changed; ``hvd.elastic.run`` resets into the next
    rendezvous round and keeps the current state (raised on every rank at the same commit).

    Args:
        skip_sync: True when no new process joins, so the state needs no broadcast.
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's hosts changed; resetting into the next rendezvous round")
        self.skip_sync = skip_sync


class HvdliteRoundSupersededError(HvdliteInternalError):
    """The rendezvous round this process was joining was replaced by a newer one before
    it formed (elastic jobs): join the newest round instead of waiting for this one."""

    def __init__(self, message: str, newest: int):
        super().__init__(message)
        self.newest = newest
