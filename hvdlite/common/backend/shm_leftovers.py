"""Named shared-memory segments that dead jobs left in /dev/shm: finding and removing them.

Named segments of dead jobs (left by earlier versions) are removed by the next
job's local rank 0 (:func:`remove_dead_segments`): only files of this user whose
header records pids none of which belongs to a live process that started before
the file last changed.  Every owner started before the segment was made (rank 0
makes it only after the round's ranks met), so a live owner always keeps it; a
recycled pid is a newer process, so it does not keep a dead job's file.  A file
that names no pid yet (its maker writes its pid microseconds after creating it)
stays for a minute.
"""

import os
import stat
import time
from typing import List, Optional

import numpy as np

from hvdlite.common.backend.shm import (
    HEADER_BYTES,
    MAX_LOCAL,
    PID_MAX,
    PIDS_AT,
    PREFIX,
    SHM_DIR,
    process_gone,
)

#: a named segment whose header names no pid is a dead creator's after this long
#: (a live one writes its pid microseconds after making the file)
_NO_OWNER_GRACE_S = 60.0


def leftover_segments(prefix: Optional[str] = None) -> List[str]:
    """Named segment files of hvdlite in /dev/shm (hvdlite itself names none any more)."""
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix or PREFIX))


def segment_owners(name: str) -> List[int]:
    """The pids recorded in the header of the named segment ``name`` in /dev/shm.

    Raises:
        OSError: it cannot be read (gone meanwhile, or another user's).
    """
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        head = f.read(HEADER_BYTES)
    return _pids_in(head)


def _pids_in(head: bytes) -> List[int]:
    pids = np.frombuffer(head[: len(head) // 8 * 8], dtype=np.int64)
    return [int(p) for p in pids[PIDS_AT : PIDS_AT + MAX_LOCAL] if 0 < p <= PID_MAX]


def remove_dead_segments(grace_s: float = _NO_OWNER_GRACE_S) -> List[str]:
    """Remove this user's named segments in /dev/shm whose owners are all dead (left by a
    job killed while its segment had a name); returns the names removed.

    A segment stays while any pid in its header is a live process that started before
    the file was made; one whose header names no pid stays for ``grace_s`` after it was
    made.  See the module's docstring for why that never removes a live job's segment.
    """
    removed = []
    for name in leftover_segments():
        path = os.path.join(SHM_DIR, name)
        try:
            if _owners_dead(path, grace_s):
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue  # gone meanwhile, or another user's: not ours to remove
    return removed


def _owners_dead(path: str, grace_s: float) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        head = os.pread(fd, HEADER_BYTES, 0)
    finally:
        os.close(fd)
    # the last change: when the file was made, or written through a mapping since (tmpfs
    # updates it then too); every owner started before the file was made, so before this
    changed = st.st_ctime
    pids = _pids_in(head)
    if not pids:
        return time.time() - changed > grace_s
    return not any(_started_before(pid, changed) for pid in pids)


def _started_before(pid: int, when: float) -> bool:
    """Whether ``pid`` is a live process that started before ``when`` (epoch seconds;
    a second of slack for /proc's boot time, which is in whole seconds)."""
    if process_gone(pid):
        return False
    started = _start_time(pid)
    return started is None or started <= when + 1.0


def _start_time(pid: int) -> Optional[float]:
    """When ``pid`` started, in epoch seconds (None if unknown: it then counts as live)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
