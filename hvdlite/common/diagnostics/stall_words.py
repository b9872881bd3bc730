"""What a stall leads to, in one wording for rank 0's warning and the launcher's report."""

#: the flag that turns a stall into an error
SHUTDOWN_FLAG = "--stall-check-shutdown-time-seconds"


def stall_outcome(shutdown_s, hint: str = SHUTDOWN_FLAG) -> str:
    """Whether the job goes on or will fail: it fails when a shutdown time ``shutdown_s``
    is set (a number above 0); ``hint`` names the settings that set one."""
    if isinstance(shutdown_s, (int, float)) and not isinstance(shutdown_s, bool) and shutdown_s > 0:
        return f"the job fails if the stall lasts {shutdown_s:g}s ({SHUTDOWN_FLAG} {shutdown_s:g})"
    return f"the job goes on (this is a warning); {hint} turns a stall into an error"
