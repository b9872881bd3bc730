"""Failure scenarios; the mode is the first argument.

kill       rank 1 dies abruptly (os._exit) after one allreduce; rank 0's next
           operations must raise HvdliteInternalError quickly, never hang.
shutdown   rank 1 calls hvd.shutdown() and lingers; rank 0 must raise, naming rank 1.
stall      rank 1 never submits 'stalled'; rank 0 gets a stall warning and, past the
           stall shutdown time, an HvdliteStallError naming the missing rank.
hang       rank 1 freezes (SIGSTOP) after one allreduce; rank 0 must raise once the op
           timeout passes, then exits 3 so the launcher tears the frozen rank down.
noinit     rank 1 never calls init(); rank 0's init must fail within the start timeout,
           naming rank 1.
cycles     20 rounds of init -> allreduce -> shutdown.
"""

import os
import signal
import sys
import time

import torch

import hvdlite.torch as hvd
from hvdlite.common.exceptions import HvdliteInternalError, HvdliteStallError

BOUND_S = 15.0


def expect_internal_error(what: str, needle: str = "") -> None:
    start = time.monotonic()
    try:
        for i in range(1000):
            hvd.allreduce(torch.ones(4), name=f"{what}.{i}")
    except HvdliteInternalError as exc:
        took = time.monotonic() - start
        print(f"RAISED {type(exc).__name__} after {took:.2f}s: {exc}", flush=True)
        assert took < BOUND_S, took
        assert needle in str(exc), (needle, str(exc))
        # later calls fail at once too
        try:
            hvd.allreduce(torch.ones(1), name="later")
        except HvdliteInternalError:
            print("LATER RAISED", flush=True)
        return
    raise AssertionError("no error although the peer is gone")


def main():
    mode = sys.argv[1]
    if mode == "cycles":
        for cycle in range(20):
            hvd.init()
            got = hvd.allreduce(
                torch.full((3,), float(cycle + hvd.rank())), op=hvd.Sum, name="cycle"
            )
            expect = float(cycle * hvd.size() + sum(range(hvd.size())))
            assert got.tolist() == [expect] * 3, (cycle, got)
            hvd.shutdown()
            hvd.shutdown()  # idempotent
        print("CYCLES DONE", flush=True)
        return
    if mode == "noinit":
        if os.environ["HVDLITE_RANK"] == "1":
            time.sleep(20)
            return
        start = time.monotonic()
        try:
            hvd.init()
        except HvdliteInternalError as exc:
            print(f"INIT FAILED after {time.monotonic() - start:.1f}s: {exc}", flush=True)
            sys.exit(4)
        raise AssertionError("init() succeeded without rank 1")
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(4), name="first")
    if mode == "kill":
        if r == 1:
            os._exit(0)
        expect_internal_error("after_kill")
    elif mode == "hang":
        if r == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        expect_internal_error("after_hang")
        sys.exit(3)
    elif mode == "shutdown":
        if r == 1:
            hvd.shutdown()
            time.sleep(2)  # alive (not dead) while rank 0 learns of the shutdown
            return
        expect_internal_error("after_shutdown", "rank 1 shut down")
    elif mode == "stall":
        if r == 0:
            h = hvd.allreduce_async(torch.ones(2), name="stalled")
            try:
                hvd.synchronize(h)
            except HvdliteStallError as exc:
                print(f"STALL ERROR: {exc}", flush=True)
                open(os.path.join(os.environ["HVD_TEST_DIR"], "stall_seen"), "w").close()
                assert "stalled" in str(exc) and "[1]" in str(exc), str(exc)
            else:
                raise AssertionError("stalled tensor completed")
        else:
            # stay away from 'stalled' until rank 0 has seen its error (bounded)
            flag = os.path.join(os.environ["HVD_TEST_DIR"], "stall_seen")
            deadline = time.monotonic() + 30
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.1)
        hvd.barrier()
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.stall").item() == 2
        print("STALL DONE", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
