"""A worker that records its pid in the folder argv[1] and sleeps: for the no-orphan test."""

import os
import sys
import time

with open(os.path.join(sys.argv[1], str(os.getpid())), "w"):
    pass
time.sleep(300)
