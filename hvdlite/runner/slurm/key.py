"""Print a new job key (hex) for a plain ``srun`` job: every rank must get the same one.

``export HVDLITE_SECRET_KEY=$(python -m hvdlite.runner.slurm.key)`` before ``srun``; srun
passes the environment to every task.  The key authenticates the rendezvous store rank 0
serves; keep it out of command lines and logs.
"""

import sys

from hvdlite.common.net.framing import new_key


def main() -> int:
    sys.stdout.write(new_key().hex() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
