"""Bad settings are refused once, by the launcher, in one line naming the flag, the file
key or the variable -- before any rank starts; and by init() for a 1-rank run."""

import os
import socket
import subprocess
import sys
import threading

import pytest

from tests import launching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(60)


def _launch(args, env=None, timeout=30):
    return launching.run(args, env=env, timeout=timeout, cwd=ROOT)


def _one_line_error(r):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("hvdlite-run: error: ")
    return lines[0]


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--start-timeout", "nan"], "--start-timeout nan: must be a finite number"),
        (["--start-timeout", "inf"], "--start-timeout inf: must be a finite number"),
        (["--op-timeout-seconds", "nan"], "--op-timeout-seconds nan: must be a finite number"),
        (["--op-timeout-seconds", "inf"], "--op-timeout-seconds inf: must be a finite number"),
        (["--fusion-threshold-mb", "-1"], "--fusion-threshold-mb -1: the value must be 0.."),
        (["--fusion-threshold-mb", "4096"], "--fusion-threshold-mb 4096: the value must be 0.."),
        (["--gloo-threads", "0"], "--gloo-threads 0: the value must be 1..1024"),
        (["--cycle-time-ms", "-3"], "--cycle-time-ms -3: the value must be 0.."),
        # the autotune bounds are rows of the same table, so the flag is named too
        (
            ["--autotune-steps-per-sample", "0"],
            "--autotune-steps-per-sample 0: the value must be >= 1",
        ),
        (
            ["--autotune-gaussian-process-noise", "0"],
            "--autotune-gaussian-process-noise 0: the value must be > 0",
        ),
    ],
)
def test_bad_flag_is_one_line_naming_the_flag(flags, expected, tmp_path):
    marker = tmp_path / "started"
    r = _launch([*flags, "-np", "2", sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"])
    assert expected in _one_line_error(r)
    assert not marker.exists(), "a rank started despite the bad setting"


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        ("hosts: [localhost, localhost]\n", "hosts: expected one value, got a list"),
        ("network-interfaces: [lo]\n", "network-interfaces: expected one value, got a list"),
        ("params:\n  fusion_threshold_mb: -1\n", "params.fusion_threshold_mb -1: the value must"),
        ("op-timeout-seconds: .nan\n", "op-timeout-seconds nan: must be a finite number"),
        (
            "library_options:\n  gloo_timeout_seconds: .inf\n",
            "library_options.gloo_timeout_seconds inf: must be a finite number",
        ),
    ],
)
def test_bad_config_file_value_names_the_key(yaml_text, expected, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    line = _one_line_error(_launch(["--config-file", str(f), "-np", "1", "true"]))
    assert f"--config-file {f}: " in line and expected in line


@pytest.mark.parametrize(
    "var, value",
    [
        ("HVDLITE_OP_TIMEOUT_SECONDS", "nan"),
        ("HOROVOD_GLOO_TIMEOUT_SECONDS", "inf"),
        ("HVDLITE_GLOO_THREADS", "0"),
        ("HVDLITE_START_TIMEOUT", "nan"),
    ],
)
def test_bad_exported_variable_is_refused_by_the_launcher(var, value):
    line = _one_line_error(_launch(["-np", "2", "true"], env={var: value}))
    assert value in line and ("HVDLITE_" in line or var in line)


def test_one_rank_run_refuses_the_same_values():
    code = "from hvdlite.common import basics; basics.start_runtime()"
    env = dict(os.environ, HVDLITE_OP_TIMEOUT_SECONDS="inf")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert r.returncode != 0
    assert "HVDLITE_OP_TIMEOUT_SECONDS=inf: must be a finite number" in r.stderr


def test_host_that_sends_no_ssh_banner_is_one_line():
    srv = socket.socket()
    srv.bind(("127.0.0.2", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # accept, then say nothing
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        r = _launch(
            ["-np", "1", "-H", "127.0.0.2:1", "-p", str(port), "--start-timeout", "2", "true"]
        )
    finally:
        stop.set()
        t.join(5)
        for c in held:
            c.close()
        srv.close()
    line = _one_line_error(r)
    assert (
        f"SSH to 127.0.0.2:{port}: the host accepted the TCP connection but sent no SSH "
        f"banner within 2s"
    ) in line
    assert "No existing session" not in r.stderr
