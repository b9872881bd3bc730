"""``python -m hvdlite.runner``: the same as ``hvdlite-run``.

For environments where the console script is not on PATH (a venv that is not
activated, ``pip install --user``): any Python that can import hvdlite can launch.
"""

import sys

from hvdlite.runner.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
