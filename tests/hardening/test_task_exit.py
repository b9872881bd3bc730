"""The task process exits cleanly while its stdin (the launcher's lifeline) is still open:
no "Fatal Python error: _enter_buffered_busy" from a stdin reader blocked at exit."""

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_task_exits_cleanly_with_stdin_open():
    payload = {
        "key": "00" * 32,
        "job_id": "j",
        "host_index": 0,
        "hostname": "h",
        "driver": [["lo", "127.0.0.1", 1]],
        "timeout_s": 1,
    }  # nothing listens
    for _ in range(3):
        p = subprocess.Popen(
            [sys.executable, "-m", "hvdlite.runner.tasks.task_service"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            p.stdin.write((json.dumps(payload) + "\n").encode())
            p.stdin.flush()  # and keep it open, as the launcher does
            code = p.wait(timeout=20)
            err = p.stderr.read().decode()
        finally:
            p.stdin.close()
            if p.poll() is None:
                p.kill()
        assert "Fatal Python error" not in err, err
        assert code == 2 and "cannot reach the driver" in err, (code, err)
