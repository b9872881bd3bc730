"""The loop every multi-process test worker runs: each case on every rank, one line each.

Prints ``OK <case> rank=R <seconds>s`` (a profile for keeping the suite short) or ``FAIL <case> rank=R`` plus the traceback, so the test
that launched the job can name the failing case and rank; exits 1 if any case failed.
"""

import sys
import time
import traceback


def run_each(cases, rank, only=None) -> int:
    """Run each ``name -> fn`` case, printing its line; ``rank()`` names this process.
    Returns how many failed."""
    failed = 0
    for name, fn in cases.items():
        if only and name not in only:
            continue
        start = time.monotonic()
        try:
            fn()
            print(f"OK {name} rank={rank()} {time.monotonic() - start:.2f}s", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name} rank={rank()}\n{traceback.format_exc()}", flush=True)
    return failed


def run_cases(hvd, cases, only=None, **init_kwargs):
    """init(**init_kwargs), every case, shutdown, exit 1 if any failed."""
    hvd.init(**init_kwargs)
    rank = hvd.rank()
    failed = run_each(cases, lambda: rank, only)
    hvd.shutdown()
    sys.exit(1 if failed else 0)
