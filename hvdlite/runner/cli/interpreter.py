"""Is the command's Python the one that has hvdlite?  A new user's commonest slip.

``hvdlite-run -np 2 python train.py`` with the virtual environment not activated runs
the ``python`` on ``PATH`` -- often the system's -- while ``hvdlite-run`` itself runs in the
environment; every rank then dies with "No module named torch".  Before anything starts,
the launcher asks the command's interpreter (when it is another file than its own)
whether it finds the modules its own Python finds, and says which it lacks, with both
paths and the fix; the launcher refuses such a command unless ``--allow-other-interpreter``
(a program may need neither module, and another interpreter may be meant).
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from typing import List, Optional

#: the modules a rank may need that the launcher's Python can tell it has
CHECKED = ("hvdlite", "torch")
#: bound on asking the command's interpreter
ASK_TIMEOUT_S = 20.0
_ASK = (
    "import importlib.util as u, sys; "
    "print(','.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
)


def mismatch(command: List[str]) -> Optional[str]:
    """The warning for ``command`` when its interpreter lacks modules this launcher's
    Python has, else None (also when it is not a Python, or cannot be asked)."""
    exe = shutil.which(command[0]) if command else None
    if exe is None or not os.path.basename(command[0]).startswith("python"):
        return None
    if os.path.realpath(exe) == os.path.realpath(sys.executable):
        return None
    ours = [m for m in CHECKED if importlib.util.find_spec(m) is not None]
    try:
        answer = subprocess.run(
            [exe, "-c", _ASK, *ours], capture_output=True, text=True, timeout=ASK_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return None
    missing = [m for m in answer.stdout.strip().split(",") if m]
    if answer.returncode != 0 or not missing:
        return None
    return (
        f"the command's interpreter {exe} ({command[0]!r} on PATH) cannot import "
        f"{', '.join(missing)}, which hvdlite-run's Python {sys.executable} can; the ranks "
        f'will fail with "No module named {missing[0]!r}". Activate the environment '
        f"hvdlite-run is installed in (e.g. source {os.path.dirname(sys.executable)}/"
        f"activate), or give its interpreter: hvdlite-run ... {sys.executable} "
        f"{' '.join(command[1:])}"
    )
