"""``hvdlite-run --check-hosts``: each host checked over a real sshd (127.0.0.2) for what a
job needs there, each failure named with its fix, exit 1 when something fails."""

import os
import sys

import pytest

from conftest import run_launcher

pytestmark = pytest.mark.timeout(120)


def _lines(out: str, mark: str):
    return [
        ln.strip()[len(mark) :].strip() for ln in out.splitlines() if ln.strip().startswith(mark)
    ]


def test_a_host_that_has_everything_passes(sshd):
    r = run_launcher(
        [
            "--check-hosts",
            "-H",
            "127.0.0.1,127.0.0.2",
            *sshd.ssh_args(),
            "--ssh-known-hosts",
            sshd.known_hosts,
            sys.executable,
            "train.py",
        ]
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert _lines(r.stdout, "[FAIL]") == [], r.stdout
    ok = _lines(r.stdout, "[ok]")
    assert "SSH login with a key" in ok and "this host (no SSH)" in ok, r.stdout
    assert any(x.startswith(f"the command's interpreter {sys.executable}: hvdlite ") for x in ok), (
        r.stdout
    )
    assert sum(x.startswith("TCP from 127.0.0.2 back to this host") for x in ok) == 1
    assert r.stdout.rstrip().endswith("every host has what a job needs")


def test_a_missing_venv_on_a_host_is_named(sshd, tmp_path):
    missing = str(tmp_path / "not-made-here" / ".venv" / "bin" / "python")
    r = run_launcher(
        [
            "--check-hosts",
            "-H",
            "127.0.0.2",
            *sshd.ssh_args(),
            "--ssh-known-hosts",
            sshd.known_hosts,
            missing,
            "train.py",
        ]
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert _lines(r.stdout, "[FAIL]") == [
        f"the command's interpreter {missing}: not found on 127.0.0.2 (make that environment "
        f"there at the same path, or give a path every host has)"
    ], r.stdout
    assert "[ok]   SSH login with a key" in r.stdout  # the other items still checked
    assert "some hosts lack what a job needs" in r.stdout


def test_a_key_the_host_refuses_is_named(sshd):
    r = run_launcher(
        [
            "--check-hosts",
            "-H",
            "127.0.0.2",
            "-p",
            str(sshd.port),
            "-i",
            sshd.wrong_identity,
            "--ssh-known-hosts",
            sshd.known_hosts,
        ]
    )
    assert r.returncode == 1, r.stdout + r.stderr
    [failed] = _lines(r.stdout, "[FAIL]")
    assert failed.startswith("SSH login with a key: ") and sshd.wrong_identity in failed, r.stdout


def test_check_hosts_needs_hosts():
    r = run_launcher(["--check-hosts"])
    assert r.returncode == 2 and "give the hosts to check with -H or --hostfile" in r.stderr


def test_the_probe_reports_a_working_directory_the_host_lacks(tmp_path):
    """The probe itself, on this host, told of a directory that does not exist."""
    from hvdlite.runner.tasks import host_check

    cmd = host_check._probe_command(sys.executable, str(tmp_path / "gone"), "", "127.0.0.1", 1)
    answer = host_check._answer(os.popen(cmd).read(), "")
    items = host_check._items(
        "b", answer, None, "127.0.0.1", 1, sys.executable, str(tmp_path / "gone"), ""
    )
    failed = [what for ok, what in items if not ok]
    assert failed[0] == (
        f"working directory {tmp_path / 'gone'}: missing on b; the ranks "
        f"would start in the home directory (copy or mount it at the same "
        f"path)"
    ), items
    assert failed[1].startswith("TCP from b back to this host (127.0.0.1:1): ")
