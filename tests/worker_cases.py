"""The loop every multi-process test worker runs: each case on every rank, one line each.

Prints ``OK <case> rank=R`` or ``FAIL <case> rank=R`` plus the traceback, so the test
that launched the job can name the failing case and rank; exits 1 if any case failed.
"""

import sys
import traceback


def run_cases(hvd, cases, only=None):
    hvd.init()
    failed = 0
    for name, fn in cases.items():
        if only and name not in only:
            continue
        try:
            fn()
            print(f"OK {name} rank={hvd.rank()}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} rank={hvd.rank()}\n{traceback.format_exc()}", flush=True)
    hvd.shutdown()
    sys.exit(1 if failed else 0)
