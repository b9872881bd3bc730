"""Issue 35 item 6.4: a timeline or flight dump that cannot be written (a full disk)
never changes a finished job's exit code, leaves no ``.tmp`` file, and the launcher
does not point at dumps that were not written; dumps are 0600 in any directory."""

import glob
import os
import subprocess
import sys
import textwrap

import pytest

from hvdlite.common.diagnostics import flight_recorder as fr
from hvdlite.common.diagnostics.timeline_writer import Timeline
from tests.runner.conftest import run_launcher
from tests.timeline.test_flight_recorder import entry

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs, filled up (root only; skipped where it cannot be mounted)."""
    d = tmp_path / "small"
    d.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with open(d / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        yield d
    finally:
        # lazily when busy (a writer that failed to close its file): never left mounted
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], check=True)


def _recorder(directory):
    rec = fr.FlightRecorder(8, str(directory))
    rec.completed("global", 1, [], [(entry(f"t{i}"), None, None) for i in range(8)])
    return rec


def test_flight_dump_is_0600_in_an_existing_0755_directory(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        path = _recorder(d).dump("asked")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_flight_dump_on_a_full_disk_fails_cleanly(full_disk, monkeypatch, caplog):
    rec = _recorder(full_disk / "flight")
    with pytest.raises(OSError):
        rec.dump("asked")
    assert glob.glob(str(full_disk / "flight" / "*")) == [], "a .tmp or half dump was left"
    monkeypatch.setattr(fr, "_CURRENT", rec)
    assert fr.dump("asked") is None and "cannot write" in caplog.text


def test_launcher_does_not_point_at_dumps_that_were_not_written(tmp_path):
    empty = tmp_path / "none"
    note = fr.launcher_note("j", str(empty), local_only=True)
    assert note.startswith(f"hvdlite-run: no flight recorder dump was written in {empty}")
    assert "hvdlite-doctor" not in note
    os.makedirs(empty)
    _recorder(empty).dump("asked")
    assert "hvdlite-doctor" in fr.launcher_note("j", str(empty), local_only=True)


def test_timeline_on_dev_full_never_raises(caplog):
    tl = Timeline("/dev/full", flush_interval_s=0.01)
    tl.queued("g", "allreduce", 0.0, 16)
    tl.done("g", 0.1, None)
    tl.close()  # nothing raised
    assert "writing failed" in caplog.text and "the job goes on" in caplog.text
    tl.queued("h", "allreduce", 0.0, 16)  # dropped, not kept in memory
    assert len(tl._events) == 0


def test_timeline_filling_the_disk_mid_run_never_raises(full_disk, caplog):
    os.remove(full_disk / "filler")
    with open(full_disk / "filler", "wb", buffering=0) as f:
        f.write(b"x" * (60 * 1024))  # a few KiB left for the trace
    tl = Timeline(str(full_disk / "t.json"), flush_interval_s=0.01)
    for i in range(3000):
        tl.queued(f"tensor.{i}", "allreduce", 0.0, 16)
        tl.done(f"tensor.{i}", 0.1, None)
    tl.close()
    assert "writing failed" in caplog.text
    assert not glob.glob(str(full_disk / "*.tmp"))


WORKER = textwrap.dedent("""
    import torch
    import hvdlite.torch as hvd
    hvd.init()
    for i in range(5):
        hvd.allreduce(torch.ones(4), name=f"g{i}")
    hvd.shutdown()
    print("TRAINED ok")
""")


@pytest.mark.timeout(90)
def test_job_with_an_unwritable_timeline_exits_0(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    r = run_launcher(
        ["-np", "1", "--timeline-filename", "/dev/full", sys.executable, str(script)], timeout=80
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TRAINED ok" in r.stdout and "No space left on device" in r.stderr
    assert "Traceback" not in r.stderr
