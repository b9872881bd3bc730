"""A rank that prints nothing and never ends on its own: ``silent.py TOKEN SECONDS``."""

import sys
import time

time.sleep(float(sys.argv[2]))
