"""MPI mode: the mpiexec command per flavour, the per-rank output wrapper, and real
runs under MPICH's Hydra."""

import glob
import importlib.util
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.starters.mpiexec import (
    HYDRA,
    INTEL,
    OPENMPI,
    build_command,
    detect_flavor,
    find_mpiexec,
    write_ssh_wrapper,
)
from hvdlite.runner.processes.rank_output import MODULE, mpi_rank, wrapper_command

from conftest import REPO, procs_with, run_launcher, wait_gone, worker
from tests import launching

pytestmark = pytest.mark.timeout(90)
HOSTS = [HostSlots("a", 2), HostSlots("b", 1)]


WRAP = ["py", "-m", MODULE, "--"]  # the wrapper as build_command writes it (python="py")


def test_hydra_command():
    cmd = build_command(
        HYDRA,
        "mpiexec",
        3,
        HOSTS,
        {"HVDLITE_CPU_OPERATIONS": "mpi"},
        ["PATH", "FOO"],
        ["-verbose"],
        ["python", "t.py"],
        ssh_port=2222,
        python="py",
        ssh_wrapper="/w/hvdlite-ssh",
    )
    assert cmd[:5] == ["mpiexec", "-n", "3", "-hosts", "a:2,b:1"]
    assert "-prepend-rank" not in cmd  # the wrapper tags the output
    assert ["-genv", "HVDLITE_CPU_OPERATIONS", "mpi"] == cmd[cmd.index("-genv") :][:3]
    assert "PYTHONUNBUFFERED" not in cmd
    assert cmd[cmd.index("-envlist") + 1] == "PATH,FOO"
    # Hydra runs -launcher-exec as one program: the port goes in a wrapper script
    assert cmd[cmd.index("-launcher-exec") + 1] == "/w/hvdlite-ssh"
    assert cmd[-7:] == ["-verbose"] + WRAP + ["python", "t.py"]


def test_openmpi_command():
    cmd = build_command(OPENMPI, "mpirun", 3, HOSTS, {"K": "v"}, ["FOO"], [], ["t"], python="py")
    assert cmd[:6] == ["mpirun", "--allow-run-as-root", "-np", "3", "-H", "a:2,b:1"]
    assert "--tag-output" not in cmd and ["-x", "K=v"] == cmd[cmd.index("-x") :][:2]
    assert cmd[-7:] == ["-x", "FOO"] + WRAP + ["t"]


def test_intel_command():
    cmd = build_command(INTEL, "mpiexec", 1, HOSTS[:1], {}, ["FOO"], [], ["t"], python="py")
    assert "-genvlist" in cmd and "-envlist" not in cmd and "-prepend-rank" not in cmd
    assert cmd[-5:] == WRAP + ["t"]


def test_wrapper_command_options():
    assert wrapper_command(["t", "--x"], output_dir="/d", timestamp=True, python="py") == [
        "py",
        "-m",
        MODULE,
        "--output-dir",
        "/d",
        "--timestamp",
        "--",
        "t",
        "--x",
    ]
    cmd = build_command(
        HYDRA, "mpiexec", 1, HOSTS[:1], {}, [], [], ["t"], output_dir="/d", python="py"
    )
    assert cmd[-6:] == ["-m", MODULE, "--output-dir", "/d", "--", "t"]


def test_mpi_rank_from_each_flavour():
    assert mpi_rank({"PMI_RANK": "3", "MPI_LOCALRANKID": "0"}) == 3  # Hydra, Intel
    assert mpi_rank({"OMPI_COMM_WORLD_RANK": "2", "PMIX_RANK": "2"}) == 2  # Open MPI
    assert mpi_rank({"PMIX_RANK": "4"}) == 4
    with pytest.raises(HvdliteConfigError, match="PMI_RANK"):
        mpi_rank({"MPI_LOCALRANKID": "0"})  # a local rank is not the world rank
    with pytest.raises(HvdliteConfigError, match="PMI_RANK='x'"):
        mpi_rank({"PMI_RANK": "x"})


# ----------------------------------------------------------------------------------------
# the wrapper alone (a fake MPI environment)


def _wrapper(child_code: str, env=None, **kw) -> subprocess.Popen:
    full_env = dict(os.environ)
    full_env.update({"PMI_RANK": "3"} if env is None else env)
    return subprocess.Popen(
        [sys.executable, "-m", MODULE, "--", sys.executable, "-c", textwrap.dedent(child_code)],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


@pytest.mark.timeout(30)
def test_wrapper_tags_lines_and_propagates_exit_code():
    p = _wrapper("""
        import os, sys
        sys.stdout.write("no newline at first, ")
        sys.stdout.write("then one\\n")
        print("err line", file=sys.stderr)
        print("unbuffered", os.environ.get("PYTHONUNBUFFERED"), end="")
        sys.exit(7)
    """)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 7
    assert out.decode().splitlines() == [
        "[3]<stdout>:no newline at first, then one",
        "[3]<stdout>:unbuffered 1",
    ]
    lines = err.decode().splitlines()
    assert lines[0] == "[3]<stderr>:err line"
    assert "rank 3" in lines[-1] and "exited with code 7" in lines[-1]


@pytest.mark.timeout(30)
def test_wrapper_signal_exit_is_128_plus_n():
    p = _wrapper("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    _, err = p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGKILL
    assert "killed by signal SIGKILL" in err.decode()


@pytest.mark.timeout(30)
def test_wrapper_forwards_sigterm_to_the_child_group():
    p = _wrapper("""
        import signal, subprocess, sys, time
        # a grandchild in the same group must get the signal too
        gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        def on_term(signum, frame):
            print("child got SIGTERM", flush=True)
            gc.wait()
            sys.exit(9 if gc.returncode == -signal.SIGTERM else 1)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        time.sleep(60)
    """)
    assert p.stdout.readline() == b"[3]<stdout>:ready\n"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert out == b"[3]<stdout>:child got SIGTERM\n", err
    assert p.returncode == 9
    assert b"hvdlite-run: rank" not in err  # a stop from outside is not a rank failure


@pytest.mark.timeout(30)
def test_wrapper_without_mpi_rank_says_what_it_expected():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
    }
    p = subprocess.run(
        [sys.executable, "-m", MODULE, "--", "true"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert p.returncode == 2
    assert "OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK" in p.stderr


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_detects_installed_mpich():
    assert detect_flavor(find_mpiexec()) == HYDRA


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_mode_end_to_end():
    r = run_launcher(
        ["--mpi", "-np", "2", "--cycle-time-ms", "2", "-x", "MPI_X_VAR=7", worker("mpi_worker.py")]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = sorted(re.findall(r"MPIOK .*", r.stdout))
    assert lines == [f"MPIOK rank={i} size=2 sum=3 cycle=2.0 x=7" for i in range(2)]


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_mode_failure_exit_code():
    r = run_launcher(["--mpi", "-np", "2", worker("mpi_worker.py"), "1"])
    assert r.returncode == 5, r.stdout + r.stderr
    assert "rank 1 on host" in r.stderr and "exited with code 5" in r.stderr
    assert "mpiexec" in r.stderr


SLOW_PRINTER = """
import sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
print(f"first rank={rank} size={comm.Get_size()}")          # no flush=True
print(f"warn rank={rank}", file=sys.stderr)
time.sleep(2)
print(f"second rank={rank} sum={comm.allreduce(rank + 1)}")
if rank == int(sys.argv[1]):
    raise SystemExit(3)
"""


def _lines_of(stream) -> "queue.Queue":
    """A queue that receives each line of ``stream`` as it arrives, then None at EOF."""
    lines: "queue.Queue" = queue.Queue()

    def run():
        for line in iter(stream.readline, ""):
            arrivals.append(time.monotonic())
            lines.put(line)
        lines.put(None)

    arrivals = []
    lines.arrivals = arrivals  # when each line was read
    threading.Thread(target=run, daemon=True).start()
    return lines


def _drain(lines: "queue.Queue", timeout_s: float = 10.0):
    got = []
    while (line := lines.get(timeout=timeout_s)) is not None:
        got.append(line)
    return got


@pytest.mark.timeout(60)
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_mode_output_is_live_and_tagged(tmp_path):
    script = tmp_path / "slow_printer.py"
    script.write_text(SLOW_PRINTER)
    proc = launching.start(
        ["--mpi", "-np", "2", sys.executable, script, "-1"], unset=["PYTHONUNBUFFERED"]
    )
    try:
        out_lines, err_lines = _lines_of(proc.stdout), _lines_of(proc.stderr)
        early = []
        deadline = time.monotonic() + 30
        while len(early) < 2:
            line = out_lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"launcher ended first: {early} {_drain(err_lines)}"
            early.append(line)
            # the ranks sleep 2 s after their first print: it must not wait for their exit
            assert proc.poll() is None, f"{line!r} arrived only after the job ended"
        assert sorted(early) == [f"[{r}]<stdout>:first rank={r} size=2\n" for r in range(2)]
        proc.wait(timeout=30)
        late, err = _drain(out_lines), _drain(err_lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, late + err
    assert sorted(late) == [f"[{r}]<stdout>:second rank={r} sum=3\n" for r in range(2)]
    # the first lines came about 2 s before the second, not all together at the end
    times = out_lines.arrivals
    assert times[2] - times[1] > 1.0, times
    assert sorted(err) == [f"[{r}]<stderr>:warn rank={r}\n" for r in range(2)]


@pytest.mark.timeout(60)
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_mode_failing_rank_exit_code_and_output_dir(tmp_path):
    script = tmp_path / "slow_printer.py"
    script.write_text(SLOW_PRINTER)
    out_dir = tmp_path / "logs"
    r = launching.run(
        ["--mpi", "-np", "2", "--output-filename", out_dir, sys.executable, script, "1"], timeout=50
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "rank 1 on host" in r.stderr and "exited with code 3" in r.stderr
    for rank in range(2):
        assert (
            out_dir / f"rank.{rank}" / "stdout"
        ).read_text() == f"first rank={rank} size=2\nsecond rank={rank} sum=3\n"
        assert (out_dir / f"rank.{rank}" / "stderr").read_text() == f"warn rank={rank}\n"


@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_mpi_mode_runtime_smoke():
    r = run_launcher(["--mpi", "-np", "2", worker("torch_worker.py")], timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(re.findall(r"TRAINOK rank=\d size=2", r.stdout)) == 2


def test_hydra_ssh_wrapper_passes_port_and_key_as_separate_arguments(tmp_path):
    """Hydra runs -launcher-exec as one program ("execvp error on file ssh -p 2222 -i K"),
    so -p/-i go into a script; a fake ssh on PATH records the argv the script gives it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    record = tmp_path / "argv"
    (fake / "ssh").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    (fake / "ssh").chmod(0o755)
    private = tmp_path / "wrap"
    private.mkdir(mode=0o700)
    key = tmp_path / "my key's file"
    key.write_text("")
    path = write_ssh_wrapper(str(private), 2222, str(key))
    assert os.stat(path).st_mode & 0o777 == 0o700
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    subprocess.run([path, "node1", "hydra_pmi_proxy", "--x"], env=env, check=True, timeout=10)
    assert record.read_text().splitlines() == [
        "-p",
        "2222",
        "-i",
        str(key),
        "node1",
        "hydra_pmi_proxy",
        "--x",
    ]
    cmd = build_command(
        HYDRA,
        "mpiexec",
        1,
        HOSTS[:1],
        {},
        [],
        [],
        ["t"],
        ssh_port=2222,
        python="py",
        ssh_wrapper=path,
    )
    assert cmd[cmd.index("-launcher-exec") + 1] == path
    with pytest.raises(Exception, match="ssh wrapper"):
        build_command(HYDRA, "mpiexec", 1, HOSTS[:1], {}, [], [], ["t"], ssh_port=2222)


@pytest.mark.timeout(60)
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_mpi_job_over_ssh_with_port_and_key(sshd, tmp_path):
    """A real MPICH job, one rank on 127.0.0.2 reached through the loopback sshd's port and
    key (-p/-i); the test's ssh shim only adds the fixture's known_hosts."""
    shim = tmp_path / "bin"
    shim.mkdir()
    real_ssh = shutil.which("ssh")
    (shim / "ssh").write_text(
        f"#!/bin/sh\nexec {real_ssh} -o UserKnownHostsFile={sshd.known_hosts} "
        f'-o StrictHostKeyChecking=yes -o BatchMode=yes "$@"\n'
    )
    (shim / "ssh").chmod(0o755)
    env = {
        "PATH": f"{shim}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}"
        f"{os.environ['PATH']}"
    }
    r = run_launcher(
        [
            "--mpi",
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            "-p",
            str(sshd.port),
            "-i",
            sshd.identity,
            "-x",
            "MPI_X_VAR=7",
            worker("mpi_worker.py"),
        ],
        env=env,
        timeout=50,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "execvp error" not in r.stderr
    lines = sorted(re.findall(r"MPIOK rank=\d size=\d sum=\d", r.stdout))
    assert lines == [f"MPIOK rank={i} size=2 sum=3" for i in range(2)], r.stdout + r.stderr
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "hvdlite-mpi-ssh-*")), (
        "the ssh wrapper's directory was left behind"
    )


def _run_bounded(cmd, timeout_s, token):
    """``cmd`` in a session of its own, killed whole (and reported as a hang) when it runs
    past ``timeout_s``; returns (returncode, stdout, stderr)."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=launching.environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for p in procs_with(token):
            p.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"hung: still running after {timeout_s}s (an MPI wait without a timeout?)\n{out}\n{err}"
        )
    return proc.returncode, out, err


@pytest.mark.timeout(60)
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
def test_every_mpi_wait_times_out_when_the_peer_is_absent():
    """Each collective of the MPI backend, its point-to-point exchange and its communicator
    constructors end in the named error within about the op timeout (1 s) while the peer
    sleeps in no collective; the backend then refuses at once (mpi_timeout_worker.py)."""
    code, out, err = _run_bounded(
        [find_mpiexec(), "-n", "2", sys.executable, worker("mpi_timeout_worker.py")],
        45,
        "mpi_timeout_worker",
    )
    assert "ALLTIMEDOUT" in out, out + err
    took = {m.group(1): float(m.group(2)) for m in re.finditer(r"TIMEDOUT (.+?) s=([\d.]+):", out)}
    assert len(took) == 10, out
    assert all(0.9 <= s <= 2.5 for s in took.values()), took
    # the abandoned operations did not keep the process in MPI_Finalize for good
    assert "MPI_Finalize gets" in err, err


@pytest.mark.timeout(90)
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec on PATH")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_mpi_stopped_rank_ends_the_job_with_the_named_timeout_error():
    """Rank 1 stops (SIGSTOP) while rank 0 waits for it in an allreduce under --mpi: rank 0
    gets the same HvdliteInternalError a Gloo wait gives, within about the op timeout, and
    the job ends with a summary and no process left."""
    start = time.monotonic()
    code, out, err = _run_bounded(
        launching.command(
            "--mpi", "-np", "2", "--op-timeout-seconds", "3", worker("mpi_stop_worker.py"), "1"
        ),
        60,
        "mpi_stop_worker",
    )
    took = time.monotonic() - start
    assert code != 0, out + err
    waited = re.search(r"WAITED rank=0 s=([\d.]+)", out)
    assert waited and float(waited.group(1)) <= 3 + 1.5, out + err
    assert re.search(
        r"ERROR HvdliteInternalError: rank 0: MPI [a-z ]+ did not complete "
        r"within 3s; a peer rank has probably exited, or stopped responding for "
        r"longer than --op-timeout-seconds \(3s\)",
        out,
    ), out + err
    assert "UNEXPECTED" not in out
    assert "hvdlite-run: rank 0 on host" in err and "exited with code 1" in err, err
    assert took < 40, took
    assert not wait_gone("mpi_stop_worker.py"), "ranks were left behind"
