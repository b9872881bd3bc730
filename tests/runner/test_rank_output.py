"""What a job's ranks print, as the launcher shows it: a stderr line that every rank prints
comes once, tagged with the ranks ([0-1]<stderr>:), each rank's own lines in their order;
tqdm's \\r updates come as updates, not one glued line; real pipes and real jobs."""

import os
import re
import sys
import threading
import time

import pytest

from conftest import run_launcher
from hvdlite.runner.processes.merged_lines import RankLineMerger, rank_label
from hvdlite.runner.processes.rank_output import OutputSink

pytestmark = pytest.mark.timeout(120)

RANKS_PRINT = """
import sys, time
import hvdlite.torch as hvd
hvd.init()
r = hvd.rank()
hvd.barrier()
sys.stderr.write("UserWarning: the same words from every rank\\n")
sys.stderr.write(f"only rank {r} says this\\n")
sys.stderr.flush()
if r == 0:
    for i in range(3):
        sys.stderr.write(f"\\r{i * 50:3d}%|bar| {i}/2")
        sys.stderr.flush()
        time.sleep(0.05)
    sys.stderr.write("\\n")
    sys.stderr.flush()
hvd.barrier()
"""


def test_rank_label_compresses_runs():
    assert rank_label([3, 0, 1, 2]) == "0-3"
    assert rank_label([0, 2]) == "0,2"
    assert rank_label([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert rank_label([4]) == "4"


def _merged(size, feed, window_s=0.2):
    out = []
    m = RankLineMerger(size, lambda label, line: out.append((label, line)), window_s)
    feed(m)
    m.close()
    return out


def test_the_same_line_from_every_rank_is_printed_once_at_once():
    got = []
    m = RankLineMerger(3, lambda label, line: got.append((label, line)), window_s=30)
    for r in (2, 0, 1):
        m.add(r, b"warn\n")
    assert got == [("0-2", b"warn\n")]  # all three: no wait for the window
    m.close()


def test_a_line_of_some_ranks_waits_out_the_window_then_names_them():
    got = []
    m = RankLineMerger(4, lambda label, line: got.append((label, line)), window_s=0.2)
    m.add(1, b"w\n")
    m.add(3, b"w\n")
    time.sleep(0.05)
    assert got == []
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got == [("1,3", b"w\n")]
    m.close()


def test_each_ranks_lines_keep_their_order():
    def feed(m):
        m.add(0, b"x\n")
        m.add(0, b"y\n")
        m.add(1, b"y\n")  # rank 1 says y first: it must not join x's entry later
        m.add(1, b"x\n")

    out = _merged(2, feed)
    per_rank = {
        r: [line for label, line in out if str(r) in label.split(",") or label == "0-1"]
        for r in (0, 1)
    }
    assert per_rank[0] == [b"x\n", b"y\n"] and per_rank[1] == [b"y\n", b"x\n"], out


def test_the_same_line_twice_from_one_rank_is_two_lines():
    out = _merged(
        2, lambda m: (m.add(0, b"a\n"), m.add(0, b"a\n"), m.add(1, b"a\n"), m.add(1, b"a\n"))
    )
    assert out == [("0-1", b"a\n"), ("0-1", b"a\n")]


def _pumped(chunks, sink_args=None):
    """Write ``chunks`` into a real pipe as a rank would, read them back through the sink."""
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    sink = OutputSink(
        out=os.fdopen(out_w, "wb"), err=os.fdopen(out_w, "wb", closefd=False), **(sink_args or {})
    )
    t = sink.attach(0, "stderr", os.fdopen(r, "rb", buffering=0))
    for c in chunks:
        os.write(w, c)
        time.sleep(0.03)
    os.close(w)
    t.join(5)
    sink.close()
    data = []
    reader = threading.Thread(target=lambda: data.append(os.read(out_r, 1 << 20)))
    reader.start()
    reader.join(5)
    os.close(out_r)
    return data[0] if data else b""


def test_progress_updates_through_a_pipe_are_lines_of_their_own():
    got = _pumped([b"start\n", b"\r  0%|", b"\r 50%|", b"\r100%|", b"\n", b"done\n"])
    assert got.split(b"\n") == [
        b"[0]<stderr>:start",
        b"[0]<stderr>:  0%|",
        b"[0]<stderr>: 50%|",
        b"[0]<stderr>:100%|",
        b"[0]<stderr>:100%|",
        b"[0]<stderr>:done",
        b"",
    ], got


def test_crlf_is_a_line_end_not_a_progress_update():
    assert _pumped([b"win\r\n", b"x\r", b"\n"]) == b"[0]<stderr>:win\n[0]<stderr>:x\n"


def _job(*extra):
    script = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ranks_print_{os.getpid()}.py")
    with open(script, "w") as f:
        f.write(RANKS_PRINT)
    try:
        return run_launcher(["-np", "2", *extra, sys.executable, script], timeout=100)
    finally:
        os.unlink(script)


def test_a_job_prints_every_ranks_warning_once_and_progress_as_updates():
    r = _job()
    assert r.returncode == 0, r.stdout + r.stderr
    same = [line for line in r.stderr.splitlines() if "the same words" in line]
    assert same == ["[0-1]<stderr>:UserWarning: the same words from every rank"], r.stderr
    for rank in (0, 1):
        assert f"[{rank}]<stderr>:only rank {rank} says this" in r.stderr.splitlines()
    bars = re.findall(r"^\[0\]<stderr>:\s*(\d+)%\|bar\|", r.stderr, re.M)
    assert bars[:3] == ["0", "50", "100"], r.stderr  # one line per update, not glued


def test_no_merge_rank_output_prints_each_ranks_line():
    r = _job("--no-merge-rank-output")
    assert r.returncode == 0, r.stdout + r.stderr
    same = sorted(line for line in r.stderr.splitlines() if "the same words" in line)
    assert same == [
        f"[{rank}]<stderr>:UserWarning: the same words from every rank" for rank in (0, 1)
    ], r.stderr


def test_the_cpp_runtimes_last_words_are_what_a_rank_died_of():
    """std::terminate's line (with the uncaught exception's what()) is kept as the rank's
    last words; a Python exception after a traceback still counts as well."""
    sink = OutputSink(out=open(os.devnull, "wb"), err=open(os.devnull, "wb"))
    try:
        for line in (
            b"terminate called after throwing an instance of 'gloo::EnforceNotMet'",
            b"  what():  [enforce fail at pair.cc:446] 10 vs 4",
            b"an unrelated line",
        ):
            sink.write(0, "stderr", line)
        for line in (
            b"Traceback (most recent call last):",
            b'  File "x.py", line 1',
            b"RuntimeError: boom",
            b"terminate called without an active exception",
        ):
            sink.write(1, "stderr", line)
        sink.write(2, "stdout", b"terminate called without an active exception")
        raised = {rank: said for rank, (said, _) in sink.raised().items()}
    finally:
        sink.close()
    assert raised[0] == (
        "terminate called after throwing an instance of "
        "'gloo::EnforceNotMet': [enforce fail at pair.cc:446] 10 vs 4"
    )
    assert raised[1].startswith("terminate called without an active exception (a C++ thread")
    assert 2 not in raised  # stdout is the program's own
