"""Stacks taken from outside a rank's process with py-spy: of real child processes (one
sleeping in a known function, one whose interpreter lock a C call holds, a shell wrapping
Python, a process that is not Python, one py-spy may not attach to), through the task
service's ``py_spy`` op, and end to end: ``hvdlite-run --dump-stacks`` / SIGUSR1 of a plain
torch.distributed program, which runs no hvdlite runtime to answer, locally and over SSH."""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from hvdlite.common.net.framing import new_key
from hvdlite.common.net.service import Client, ServiceError
from hvdlite.runner.processes import py_spy
from hvdlite.runner.store.stack_collection import StackReports, format_outside, format_report
from hvdlite.runner.tasks.task_service import TaskService, fit_reply

from conftest import REPO, worker

from tests import launching

needs_py_spy = pytest.mark.skipif(
    py_spy.find_py_spy() is None, reason="py-spy is not installed (pip install py-spy)"
)
needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)
pytestmark = needs_py_spy

SLEEPER = """
import sys, time
def sleep_in_a_known_function():
    print("READY", flush=True)
    time.sleep(120)
sleep_in_a_known_function()
"""

GIL_HOLDER = """
import ctypes, threading, time
def side_thread():
    while True:
        time.sleep(0.05)
threading.Thread(target=side_thread, name="side", daemon=True).start()
def hold_the_interpreter_lock():
    print("READY", flush=True)
    ctypes.PyDLL(None).usleep(120_000_000)      # the lock stays held: no thread runs
hold_the_interpreter_lock()
"""

NOT_DUMPABLE = """
import ctypes, time
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)         # PR_SET_DUMPABLE 0: ptrace needs CAP_SYS_PTRACE
def sleep_in_a_known_function():
    print("READY", flush=True)
    time.sleep(120)
sleep_in_a_known_function()
"""


class _Child:
    """A child process started from ``argv`` that prints READY once it is where a test
    wants it; killed (with its tree) at the end."""

    def __init__(self, argv, **kw):
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, start_new_session=True, **kw
        )

    def ready(self):
        assert self.proc.stdout.readline().strip() == "READY"
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _script(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _functions(threads):
    return [frame[2] for thread in threads for frame in thread["frames"]]


# ---------------------------------------------------------------- py_spy.dump


@pytest.mark.timeout(60)
def test_dump_shows_the_function_a_child_sleeps_in(tmp_path):
    script = _script(tmp_path, "sleeper.py", SLEEPER)
    with _Child([sys.executable, script]) as child:
        child.ready()
        got = py_spy.dump(child.proc.pid, timeout_s=30)
    assert got.pid == child.proc.pid and got.note == "", got
    main = got.threads[0]
    assert main["main"] and main["name"] == "MainThread", got
    # the rank's own form: outermost frame first, [path, line, function, runtime]
    assert [f[2] for f in main["frames"]] == ["<module>", "sleep_in_a_known_function"], main
    module, inner = main["frames"]
    assert inner[0] == script and isinstance(inner[1], int) and inner[3] is False, inner
    text = format_report("all", {"expected": [3]}, {3: ("h", got.pid, got.threads, False)})
    assert f"sleep_in_a_known_function ({script}:" in text, text


@pytest.mark.timeout(60)
def test_dump_shows_a_child_whose_interpreter_lock_a_c_call_holds(tmp_path):
    script = _script(tmp_path, "gil.py", GIL_HOLDER)
    with _Child([sys.executable, script]) as child:
        child.ready()
        time.sleep(0.3)
        got = py_spy.dump(child.proc.pid, timeout_s=30)
    assert got.note == "" and got.pid == child.proc.pid, got
    main = [t for t in got.threads if t["main"]]
    assert len(main) == 1 and main[0]["frames"][-1][2] == "hold_the_interpreter_lock", got
    assert main[0].get("gil") is True, got
    assert "side_thread" in _functions(got.threads), got
    text = format_outside(7, [(("h", 0), 1, got)])
    assert "thread MainThread (main, holds the interpreter lock):" in text, text
    assert f"rank 1 (host h, pid {got.pid}; taken from outside the process by py-spy):" in text


@pytest.mark.timeout(60)
def test_a_process_that_is_not_python_gets_a_note():
    sleep = shutil.which("sleep")
    with _Child([sleep, "60"]) as child:
        got = py_spy.dump(child.proc.pid, timeout_s=30)
        tree = py_spy.dump_tree(child.proc.pid, timeout_s=30)
    assert got.threads is None and "is not a Python process" in got.note, got
    assert tree.threads is None and "(sleep) is not a Python process" in tree.note, tree
    gone = py_spy.dump(child.proc.pid, timeout_s=30)
    assert gone.threads is None and "has exited" in gone.note, gone


@pytest.mark.timeout(60)
def test_dump_tree_finds_the_python_process_a_shell_started(tmp_path):
    script = _script(tmp_path, "sleeper.py", SLEEPER)
    # "; true" keeps the shell from exec'ing: the python process is its child
    with _Child(["/bin/sh", "-c", f"{sys.executable} {script}; true"]) as child:
        child.ready()
        got = py_spy.dump_tree(child.proc.pid, timeout_s=30)
        kids = psutil.Process(child.proc.pid).children()
    assert got.pid != child.proc.pid and got.pid in [k.pid for k in kids], got
    assert "sleep_in_a_known_function" in _functions(got.threads), got


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    shutil.which("setpriv") is None or os.geteuid() != 0,
    reason="needs root and setpriv to take CAP_SYS_PTRACE away",
)
def test_a_ptrace_denial_says_what_to_do(tmp_path):
    """A process that is not dumpable may be read only with CAP_SYS_PTRACE: py-spy run
    without it (as in a container without --cap-add SYS_PTRACE) is refused."""
    script = _script(tmp_path, "private.py", NOT_DUMPABLE)
    with _Child([sys.executable, script]) as child:
        child.ready()
        out = subprocess.run(
            [
                "setpriv",
                "--bounding-set=-sys_ptrace",
                "--inh-caps=-sys_ptrace",
                sys.executable,
                "-c",
                f"from hvdlite.runner.processes import py_spy; "
                f"print(py_spy.dump({child.proc.pid}, 30).note)",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
    assert out.returncode == 0, out.stderr
    assert "ptrace denied" in out.stdout and "--cap-add SYS_PTRACE" in out.stdout, out.stdout
    assert "kernel.yama.ptrace_scope" in out.stdout, out.stdout


def test_without_py_spy_the_note_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(py_spy, "find_py_spy", lambda: None)
    got = py_spy.dump(os.getpid())
    assert got.threads is None and "pip install py-spy" in got.note, got


def test_threads_from_another_host_are_kept_to_the_ranks_form():
    raw = [
        {
            "name": "MainThread",
            "main": True,
            "gil": True,
            "frames": [["/a.py", 3, "f", False], ["bad"], ["/b.py", "x", "g", False]],
        },
        "junk",
        {"name": "t", "frames": "no"},
    ]
    assert py_spy.valid_threads(raw) == [
        {"name": "MainThread", "main": True, "gil": True, "frames": [["/a.py", 3, "f", False]]}
    ]
    assert py_spy.valid_threads({"not": "a list"}) is None


# ---------------------------------------------------------------- the task service's op


@pytest.mark.timeout(60)
def test_the_task_service_op_validates_and_bounds_its_reply():
    key = new_key()
    calls = []

    def on_py_spy(slots, timeout_s):
        calls.append((slots, timeout_s))
        return [{"slot": list(s), "pid": 1, "threads": [], "note": ""} for s in slots]

    task = TaskService(
        key,
        "joby",
        0,
        on_run=lambda *a: None,
        on_terminate=lambda: None,
        bind_addr="127.0.0.1",
        on_py_spy=on_py_spy,
    )
    client = Client(task.address, key, 5, name="task")
    try:
        for bad in (
            {"slots": "x", "timeout_s": 1},
            {"slots": [["h", "0"]], "timeout_s": 1},
            {"slots": [["h", 0]], "timeout_s": 0},
            {"slots": [["h", 0]]},
            {"slots": [["h", 0]], "timeout_s": 61},
            {"slots": [["h", 0]], "timeout_s": True},
            {"slots": [["h", i] for i in range(1025)], "timeout_s": 1},
        ):
            with pytest.raises(ServiceError, match="malformed request"):
                client.request({"op": "py_spy", **bad})
        assert calls == []
        reply, _ = client.request({"op": "py_spy", "slots": [["h", 0]], "timeout_s": 2.5})
        assert reply["stacks"] == [{"slot": ["h", 0], "pid": 1, "threads": [], "note": ""}]
        assert calls == [([("h", 0)], 2.5)]
    finally:
        client.close()
        task.shutdown()
    big = [
        {"slot": ["h", i], "pid": i, "threads": [{"name": "x" * 1000}], "note": ""}
        for i in range(10)
    ]
    fitted = fit_reply(big, 5000)
    assert fitted[0]["threads"] and fitted[-1]["threads"] is None
    assert "stacks dropped" in fitted[-1]["note"]


READY_FILE = """
import os, sys, time
def sleep_in_a_known_function():
    open(os.path.join(sys.argv[1], f"ready.{os.getpid()}"), "w").close()
    time.sleep(120)
sleep_in_a_known_function()
"""


@pytest.mark.timeout(120)
def test_the_task_starter_takes_its_workers_stacks_through_each_hosts_task(tmp_path):
    """Two hosts (both this machine, each with a task service subprocess, as over SSH):
    ``outside_stacks`` asks each host's task, whose py-spy reads its own worker."""
    from hvdlite.runner.hosts import HostSlots, SlotInfo
    from hvdlite.runner.processes.rank_output import OutputSink
    from hvdlite.runner.starters.ssh_tasks import TaskStarter
    from hvdlite.runner.tasks.ssh import SSHOptions

    script = _script(tmp_path, "sleeper.py", READY_FILE)
    env = {k: os.environ[k] for k in ("PATH", "PYTHONPATH") if k in os.environ}
    sink = OutputSink()
    starter = TaskStarter(
        new_key(),
        "jobo",
        [sys.executable, script, str(tmp_path)],
        lambda: {},
        env,
        SSHOptions(),
        start_timeout_s=30,
        sink=sink,
    )
    hosts = ["localhost", "127.0.0.1"]
    try:
        assert starter.prepare([HostSlots(h, 1) for h in hosts]) == {}
        slots = [
            SlotInfo(
                h,
                rank=i,
                local_rank=0,
                cross_rank=i,
                size=2,
                local_size=1,
                cross_size=2,
                host_index=i,
                host_count=2,
            )
            for i, h in enumerate(hosts)
        ]
        assert starter.start(slots) == {}
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready.*"))) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        pids = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("ready.*"))
        got = starter.outside_stacks([(h, 0) for h in hosts] + [("localhost", 5)], 30)
    finally:
        starter.stop_all()
        starter.close()
        sink.close()
    assert sorted(got) == sorted((h, 0) for h in hosts), got
    assert sorted(stack.pid for stack in got.values()) == pids, got
    for stack in got.values():
        assert stack.note == "" and "sleep_in_a_known_function" in _functions(stack.threads), stack
    assert not [pid for pid in pids if _alive(pid)]


# ---------------------------------------------------------------- the report's hooks


@pytest.mark.timeout(60)
def test_a_missing_rank_is_shown_with_the_stack_taken_from_outside(monkeypatch, tmp_path):
    """A report whose expected rank never answered asks ``outside_for_ranks`` for it."""
    from hvdlite.runner.store import stack_collection

    monkeypatch.setattr(stack_collection, "ANSWER_WAIT_S", 0.2)
    script = _script(tmp_path, "gil.py", GIL_HOLDER)
    written, asked = [], []
    with _Child([sys.executable, script]) as child:
        child.ready()

        def for_ranks(ranks):
            asked.append(ranks)
            return [(("hostb", 0), 1, py_spy.dump(child.proc.pid, 30))]

        reports = StackReports(write=written.append, outside_for_ranks=for_ranks)
        take = reports.ops()["stack_report"]
        take(
            {
                "kind": "stall",
                "id": 3,
                "rank": 0,
                "host": "h0",
                "pid": 10,
                "expected": [1],
                "tensors": [["grad.w", [0], [1], 61.0]],
            },
            b"",
        )
        deadline = time.monotonic() + 40
        while not written and time.monotonic() < deadline:
            time.sleep(0.05)
        reports.close()
    assert asked == [[1]] and len(written) == 1, written
    report = written[0]
    assert re.search(
        rf"rank 1 \(host hostb, pid {child.proc.pid}; neither its background "
        rf"thread nor its stack poller answered within 0s; taken from outside "
        rf"the process by py-spy\):",
        report,
    ), report
    assert "hold_the_interpreter_lock (" in report, report


# ---------------------------------------------------------------- end to end


class _Launch:
    """hvdlite-run as a child process; its output lines collected as they arrive."""

    def __init__(self, args):
        self.proc = launching.start(args, stderr=subprocess.STDOUT)
        self.lines = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern, timeout_s, count=1):
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                found = [m for m in (re.search(pattern, ln) for ln in self.lines) if m]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"no {count} lines match {pattern!r}:\n{self.text()}"
                self._cond.wait(left)

    def text(self):
        with self._cond:
            return "\n".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _check_outside_report(args, tmp_path, use_signal):
    """np=2 plain torch.distributed ranks wait in user code, rank 1 holding its interpreter
    lock; a stack request is answered from outside; then the job is stopped and leaves no
    process behind."""
    flag = str(tmp_path / "never")
    job = _Launch(
        args + [sys.executable, worker("outside_worker.py"), flag, "--hold-gil-rank", "1"]
    )
    pids = {}
    try:
        for m in job.wait_for(r"<stdout>:BLOCKING rank=(\d) pid=(\d+)", 90, count=2):
            pids[int(m.group(1))] = int(m.group(2))
        if use_signal:
            os.kill(job.proc.pid, signal.SIGUSR1)
        else:
            asked = launching.run(["--dump-stacks", job.proc.pid], timeout=60)
            assert asked.returncode == 0, asked.stderr
        job.wait_for(r"^hvdlite-run: stacks of every rank, on request 1: no rank asked for it", 60)
        job.wait_for(r"^\s+wait_in_user_code \(", 30, count=2)
        time.sleep(0.5)
        job.proc.send_signal(signal.SIGTERM)
        job.proc.wait(timeout=60)
    finally:
        job.kill()
    job._reader.join(10)
    text = job.text()
    report = text[text.index("hvdlite-run: stacks of every rank, on request 1:") :]
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank} \(host [^,]+, pid {pids[rank]}; taken from outside "
            rf"the process by py-spy\):",
            report,
        ), text
    assert report.count("wait_in_user_code (" + worker("outside_worker.py")) == 2, text
    assert "(main, holds the interpreter lock):" in report, text
    assert "'py-spy dump --pid PID'" not in text, text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = [pid for pid in pids.values() if _alive(pid)]
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, f"ranks {alive} outlived the job:\n{text}"
    return text


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@needs_torch
@pytest.mark.timeout(180)
def test_dump_stacks_of_a_plain_torch_program_local(tmp_path):
    _check_outside_report(["-np", "2"], tmp_path, use_signal=False)


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigusr1_of_a_plain_torch_program_over_ssh(sshd, tmp_path):
    _check_outside_report(
        ["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", *sshd.ssh_args()], tmp_path, use_signal=True
    )
