"""Stall reports with the stacks of the missing ranks, and stacks on demand
(``--dump-stacks`` / SIGUSR1): the report's text, and real np=2 jobs launched
locally, over the loopback SSH hosts and under --mpi."""

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from hvdlite.common.diagnostics import stack_capture as stack_report
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.net.framing import new_key
from hvdlite.common.net.service import Client, ServiceError
from hvdlite.runner.store.stack_collection import (
    ReportStore,
    StackReports,
    format_report,
    signal_launcher,
)
from hvdlite.runner.starters.mpiexec import find_mpiexec

from conftest import REPO, worker

from tests import launching

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)
WORKER = worker("stall_worker.py")
USER_FUNCTION = "dawdle_in_user_code"
WARNING = "stall: tensor 'stall.grad' was submitted by ranks [0] but not yet by ranks [1]"


# ---------------------------------------------------------------- the report's text


def _frame(path, line, func):
    return [path, line, func, stack_report.is_runtime_file(path)]


def test_report_puts_user_frames_first_and_folds_runtime_frames():
    ops = os.path.join(os.path.dirname(os.path.dirname(stack_report.__file__)), "ops.py")
    threads = [
        {
            "name": "hvdlite-background-r1",
            "main": False,
            "frames": [_frame(threading.__file__, 10, "run"), _frame(ops, 5, "loop")],
        },
        {
            "name": "MainThread",
            "main": True,
            "frames": [
                _frame("/home/u/train.py", 50, "<module>"),
                _frame("/home/u/train.py", 20, "train_step"),
                _frame(ops, 7, "synchronize"),
                _frame(threading.__file__, 3, "wait"),
            ],
        },
    ]
    summary = {
        "expected": [1, 2],
        "tensors": [["grad.w", [0], [1, 2], 3.2]],
        "stalled": 3,
        "hint": "--stall-check-shutdown-time-seconds",
    }
    text = format_report(stack_report.STALL, summary, {1: ("node7", 4242, threads, False)})
    lines = text.splitlines()
    assert lines[0].startswith("hvdlite-run: stall: ranks [0] wait for ranks [1, 2]")
    assert "tensor 'grad.w': submitted by ranks [0], not by ranks [1, 2]" in text
    assert "... and 2 more tensors" in text
    assert "rank 1 (host node7, pid 4242):" in text
    main = lines.index("    thread MainThread (main):")
    # innermost first: the runtime frames under the user's code folded on one line
    assert lines[main + 1].startswith(
        "      [runtime: wait (threading.py:3) < synchronize (common/ops.py:7)"
    )
    assert lines[main + 2] == "      train_step (/home/u/train.py:20)"
    assert lines[main + 3] == "      <module> (/home/u/train.py:50)"
    assert "+ 1 runtime threads: hvdlite-background-r1 in loop" in text
    assert re.search(r"rank 2: no stacks within \d+s", text)
    assert text.rstrip().endswith("--stall-check-shutdown-time-seconds turns a stall into an error")


def test_capture_sees_this_thread_and_marks_test_code_as_user_code():
    threads = stack_report.capture()
    main = next(t for t in threads if t["main"])
    assert threads[0] is main
    names = [f[2] for f in main["frames"] if not f[3]]
    assert "test_capture_sees_this_thread_and_marks_test_code_as_user_code" in names


@pytest.mark.timeout(20)
def test_collector_writes_one_report_once_all_expected_ranks_answered():
    written = []
    reports = StackReports(write=written.append)
    key = new_key()
    store = ReportStore(key, reports.ops())
    client = Client(store.address, key, 5.0)
    try:
        base = {"op": "stack_report", "kind": "all", "id": 7, "host": "h"}
        client.request(dict(base, rank=1, pid=11), b"[]")
        assert reports.written == 0
        client.request(dict(base, rank=0, pid=10, expected=[0, 1]), b"[]")
        deadline = time.monotonic() + 5
        while not written and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(written) == 1 and "rank 0 (host h, pid 10)" in written[0]
        assert "rank 1 (host h, pid 11)" in written[0]
        with pytest.raises(ServiceError, match="stack_report: kind, id, rank"):
            client.request({"op": "stack_report", "kind": "all", "id": "x"})
        with pytest.raises(ServiceError, match="takes only"):
            client.request({"op": "set", "key": "k"})
        assert reports.request_all() == 1
        assert client.request({"op": "stacks_wanted"})[0]["wanted"] == 1
        deadline = time.monotonic() + 5
        while len(written) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.request(dict(base, id=1, rank=0, pid=10, expected=[0]), b"[]")
        assert client.request({"op": "stacks_wanted"})[0]["wanted"] == 0  # answered
    finally:
        client.close()
        store.shutdown()
        reports.close()
    assert "request 1" in written[1] and len(written) == 3, written


def test_dump_stacks_refuses_a_process_that_is_no_launcher():
    with pytest.raises(
        HvdliteConfigError, match=f"--dump-stacks {os.getpid()}: not an hvdlite launcher"
    ):
        signal_launcher(os.getpid())


# ---------------------------------------------------------------- real jobs


class Launch:
    """hvdlite-run as a child process, each output line timestamped as it arrives."""

    def __init__(self, args, env=None):
        self.proc = launching.start(args, env=env)
        self.lines = []  # (arrival time, line)
        self._cond = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(s,), daemon=True)
            for s in (self.proc.stdout, self.proc.stderr)
        ]
        for r in self._readers:
            r.start()

    def _read(self, stream):
        for line in stream:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()

    def wait_for(self, pattern, timeout_s, count=1):
        """Arrival time of the ``count``-th line matching ``pattern`` (fails after
        timeout_s)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                arrivals = [at for at, line in self.lines if re.search(pattern, line)]
                if len(arrivals) >= count:
                    return arrivals[count - 1]
                left = deadline - time.monotonic()
                assert left > 0, (
                    f"fewer than {count} lines match {pattern!r} in {timeout_s}s:\n{self.text()}"
                )
                self._cond.wait(left)

    def finish(self, timeout_s):
        code = self.proc.wait(timeout=timeout_s)
        for r in self._readers:
            r.join(5)
        return code

    def text(self):
        return "\n".join(line for _, line in self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _check_stall_report(args, seconds, flag=None, timeout_s=90, warnings=1):
    """Rank 1 dawdles ``seconds`` (or until ``flag`` exists, once the report and
    ``warnings`` stall warnings came) while rank 0 waits: within 10 s of the warning, the
    report names rank 1 and the function; the job ends with 0."""
    job = Launch(
        args
        + ["--stall-check-warning-time-seconds", "2", WORKER, "stall", str(seconds)]
        + ([flag] if flag else [])
    )
    try:
        warned = job.wait_for(re.escape(WARNING), 40)
        reported = job.wait_for(r"^hvdlite-run: stall: ranks \[0\] wait for ranks \[1\]", 15)
        job.wait_for(re.escape(WARNING), 20, count=warnings)
        if flag:
            open(flag, "w").close()
        assert reported - warned < 10, job.text()
        assert job.finish(timeout_s) == 0, job.text()
    finally:
        job.kill()
    text = job.text()
    report = text[text.index("hvdlite-run: stall:") :]
    assert re.search(r"rank 1 \(host [^,]+, pid \d+\):", report), text
    assert USER_FUNCTION + " (" + WORKER in report, text
    assert text.count("hvdlite-run: stall:") == 1, text  # once per stall
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS turns a stall into an error" in text
    assert len(re.findall(r"STALLOK rank=\d", text)) == 2, text
    return text


@needs_torch
@pytest.mark.timeout(90)
def test_stall_report_names_the_missing_rank_and_its_function_local(tmp_path):
    # rank 1 sleeps up to 25 s in user code; it wakes once the report and a repeat came
    text = _check_stall_report(["-np", "2"], 25, flag=str(tmp_path / "seen"), warnings=2)
    # the minute warning repeats (Horovod's behaviour), the stack report does not
    assert text.count(WARNING) >= 2, text


@needs_torch
@pytest.mark.timeout(90)
def test_stall_report_says_the_missing_rank_left_the_collective_by_raising(tmp_path):
    """Rank 1 raised out of the allreduce (a set it is not in) and went elsewhere, as a test
    harness does after a failed test: the report says why it is not in the collective."""
    flag = str(tmp_path / "seen")
    job = Launch(
        ["-np", "2", "--stall-check-warning-time-seconds", "2", WORKER, "raise", "40", flag]
    )
    try:
        job.wait_for(r"^hvdlite-run: stall: ranks \[0\] wait for ranks \[1\]", 40)
        open(flag, "w").close()
        assert job.finish(60) == 0, job.text()
    finally:
        job.kill()
    text = job.text()
    report = text[text.index("hvdlite-run: stall:") :]
    assert re.search(
        r"rank 1 left the collective by raising ValueError: rank 1 is not a "
        r"member of process set 1 .*\(at [^ ]*stall_worker\.py:\d+ in main, "
        r"[\d.]+s before these stacks\)",
        report,
    ), text
    assert USER_FUNCTION + " (" + WORKER in report, text


@needs_torch
@pytest.mark.timeout(90)
def test_stall_report_over_ssh(sshd, tmp_path):
    _check_stall_report(
        ["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args()],
        40,
        flag=str(tmp_path / "seen"),
    )


@needs_torch
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
@pytest.mark.timeout(90)
def test_stall_report_under_mpi(tmp_path):
    _check_stall_report(["--mpi", "-np", "2"], 40, flag=str(tmp_path / "seen"))


@needs_torch
@pytest.mark.timeout(90)
def test_stall_report_in_an_elastic_job(tmp_path):
    _check_stall_report(
        ["-np", "2", "--min-np", "2", "--max-np", "2", "-H", "localhost:2"],
        40,
        flag=str(tmp_path / "seen"),
    )


@needs_torch
@pytest.mark.timeout(90)
def test_dump_stacks_prints_every_ranks_stacks(tmp_path):
    # the worker asks in its second round: a new runtime, and a new poller on rank 0
    flag = str(tmp_path / "seen")
    job = Launch(["-np", "2", WORKER, "dump", "40", flag])
    try:
        job.wait_for(r"DAWDLING rank=0", 40)
        job.wait_for(r"DAWDLING rank=1", 10)
        asked = launching.run(["--dump-stacks", job.proc.pid], timeout=30)
        assert asked.returncode == 0, asked.stderr
        assert "the report appears in that launcher's output" in asked.stdout
        job.wait_for(r"^hvdlite-run: stacks of every rank, on request", 15)
        open(flag, "w").close()
        assert job.finish(60) == 0, job.text()
    finally:
        job.kill()
    text = job.text()
    report = text[text.index("hvdlite-run: stacks of every rank, on request") :]
    for rank in (0, 1):
        assert re.search(rf"rank {rank} \(host [^,]+, pid \d+\):", report), text
    assert report.count(USER_FUNCTION + " (") == 2, text


_BLOCKED_RANK = """
import os, sys, threading
from hvdlite.common.diagnostics import stack_capture as stack_report
target = stack_report.Target((sys.argv[1], int(sys.argv[2])), bytes.fromhex(os.environ["KEY"]),
                             "blockedhost")
stack_report.Poller(target, 1, period_s=0.2).start()

def blocked_in_c_lock():
    lock = threading.Lock()
    lock.acquire()
    print("BLOCKING", flush=True)
    lock.acquire()          # blocks in C for good; no runtime runs in this process

blocked_in_c_lock()
"""


@pytest.mark.timeout(30)
def test_a_rank_whose_background_thread_never_answers_is_reported_by_its_poller(tmp_path):
    """A missing rank that cannot answer through the control vector (no background thread
    cycles there: here there is none at all) and whose main thread is blocked in C code:
    the launcher asks its stack poller, whose own thread sends the main thread's stack."""
    written = []
    reports = StackReports(write=written.append)
    key = new_key()
    store = ReportStore(key, reports.ops())
    script = tmp_path / "blocked_rank.py"
    script.write_text(_BLOCKED_RANK)
    env = dict(
        os.environ,
        KEY=key.hex(),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    rank1 = subprocess.Popen(
        [sys.executable, str(script), *map(str, store.address)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    client = Client(store.address, key, 5.0)
    try:
        assert rank1.stdout.readline().strip() == "BLOCKING"
        # rank 0's part of a stall report: rank 1 is missing
        client.request(
            {
                "op": "stack_report",
                "kind": "stall",
                "id": 5,
                "rank": 0,
                "host": "h0",
                "pid": 10,
                "expected": [1],
                "tensors": [["grad.w", [0], [1], 61.0]],
            }
        )
        deadline = time.monotonic() + 15
        while not written and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()
        rank1.kill()
        rank1.wait()
        store.shutdown()
        reports.close()
    assert len(written) == 1, written
    report = written[0]
    assert (
        f"rank 1 (host blockedhost, pid {rank1.pid}; its background thread did not "
        f"answer, its stack poller thread took these):"
    ) in report, report
    assert "blocked_in_c_lock (" in report and "thread MainThread (main):" in report, report


def test_stall_messages_say_the_job_fails_when_a_shutdown_time_is_set():
    """With --stall-check-shutdown-time-seconds the stall is not 'only a warning': the
    launcher's report and rank 0's warning say the job will fail, and when."""
    from hvdlite.common.config import Config
    from hvdlite.common.diagnostics.stall_words import stall_outcome

    base = {
        "expected": [1],
        "tensors": [["g", [0], [1], 2.0]],
        "stalled": 1,
        "hint": "--stall-check-shutdown-time-seconds",
    }
    text = format_report(stack_report.STALL, {**base, "shutdown_s": 30.0}, {})
    assert "the job goes on" not in text and "warning" not in text
    assert text.rstrip().endswith(
        "the job fails if the stall lasts 30s (--stall-check-shutdown-time-seconds 30)"
    )
    text = format_report(stack_report.STALL, {**base, "shutdown_s": 0.0}, {})
    assert "the job goes on (this is a warning)" in text
    # rank 0's warning says it in the same words
    assert (
        stall_outcome(Config(stall_check_shutdown_time_s=30.0).stall_check_shutdown_time_s)
        == "the job fails if the stall lasts 30s (--stall-check-shutdown-time-seconds 30)"
    )
    assert stall_outcome(Config().stall_check_shutdown_time_s).endswith(
        "turns a stall into an error"
    )


def test_a_request_no_rank_polls_for_is_said_to_be_unanswerable(monkeypatch):
    """Ranks that run no hvdlite runtime (a plain torch.distributed program) never poll:
    the launcher says so, once, instead of staying silent."""
    from hvdlite.runner.store import stack_collection

    monkeypatch.setattr(stack_collection, "UNPOLLED_S", 0.3)
    written = []
    reports = StackReports(write=written.append)
    reports.start()
    try:
        reports.request_all()
        deadline = time.monotonic() + 5
        while len(written) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)  # and not a second time
    finally:
        reports.close()
    assert len(written) == 2, written
    assert "request 1" in written[0]
    assert "no rank asked for request 1 within 0s" in written[1] and "py-spy" in written[1]
