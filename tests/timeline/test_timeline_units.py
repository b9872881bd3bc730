"""Timeline writer, tolerant reader and autotuner logic in one process (no launcher)."""

import json
import sys
import threading
import time

import pytest

from hvdlite.common.engine import autotune
from hvdlite.common.config import Config
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.common.engine.parameters import Parameters
from hvdlite.common.diagnostics.recorder import (
    COLLECTIVE,
    COPY_IN,
    COPY_OUT,
    NULL,
    Recorder,
    Tee,
    combine,
)
from hvdlite.common.diagnostics.timeline_writer import Timeline, load_events

pytestmark = pytest.mark.timeout(60)


def feed_one_fused_op(tl, t):
    tl.cycle(1, t)
    for n in ("x", "y"):
        tl.queued(n, "allreduce", t - 0.001, 64)
    tl.negotiated("x", t + 0.001, [1])
    tl.negotiated("y", t + 0.001, [])
    tl.span(COPY_IN, ["x", "y"], t + 0.001, t + 0.002, 0)
    tl.span(COLLECTIVE, ["x", "y"], t + 0.002, t + 0.004, 0)
    tl.span(COPY_OUT, ["x", "y"], t + 0.004, t + 0.005, 0)
    tl.done("x", t + 0.005, None)
    tl.done("y", t + 0.005, RuntimeError("boom"))


def test_timeline_is_readable_while_open_cut_short_and_closed(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), mark_cycles=True, backend_name="gloo", flush_interval_s=0.01)
    feed_one_fused_op(tl, time.monotonic())
    deadline = time.monotonic() + 5
    while '"ALLREDUCE"' not in path.read_text():  # the writer thread flushed it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    open_text = path.read_text()
    with pytest.raises(ValueError):
        json.loads(open_text)  # no closing bracket yet
    events = load_events(str(path))
    x = [e for e in events if e.get("ph") == "X" and e["tid"] == 1]
    assert [e["name"] for e in x] == [
        "QUEUED",
        "NEGOTIATE_ALLREDUCE",
        "MEMCPY_IN_FUSION_BUFFER",
        "GLOO_ALLREDUCE",
        "MEMCPY_OUT_FUSION_BUFFER",
        "ALLREDUCE",
    ]
    assert x[1]["args"]["waited_for"] == [1] and x[0]["args"]["bytes"] == 64
    y_op = [e for e in events if e.get("tid") == 2 and e.get("name") == "ALLREDUCE"]
    assert y_op[0]["args"]["error"] == "boom"
    assert {e["ph"] for e in events if e.get("cat") == "fused"} == {"b", "e"}
    assert any(e.get("name") == "CYCLE_START" for e in events)
    # a write cut in the middle of its last line: dropped, as chrome://tracing does
    cut = tmp_path / "cut.json"
    cut.write_text(open_text + '{"name": "QUEUED", "ph": "X", "pi')
    assert len(load_events(str(cut))) == len(events)
    # a broken line in the middle is not a timeline
    bad = tmp_path / "bad.json"
    lines = open_text.splitlines()
    bad.write_text("\n".join(lines[:3] + ["{nonsense"] + lines[3:]))
    with pytest.raises(ValueError, match="bad.json:4"):
        load_events(str(bad))
    tl.close()
    tl.close()  # idempotent
    assert len(json.loads(path.read_text())) == len(events) + 1  # + timeline_end


def test_timeline_refuses_an_unwritable_path(tmp_path):
    with pytest.raises(HvdliteConfigError, match="cannot write"):
        Timeline(str(tmp_path / "no" / "such" / "dir.json"))


def test_combine_skips_inactive_recorders():
    class On(Recorder):
        active = True

        def __init__(self):
            self.seen = []

        def done(self, name, end, error):
            self.seen.append(name)

    a, b = On(), On()
    assert combine([NULL, NULL]) is NULL and combine([NULL, a]) is a
    tee = combine([a, NULL, b])
    assert isinstance(tee, Tee) and tee.active
    tee.done("n", 0.0, None)
    assert a.seen == b.seen == ["n"]


def test_points_and_parameters_round_trip():
    p = Parameters(32 << 20, 8 << 20, 1 << 20, 2.5, False)
    assert autotune.from_point(p, autotune.to_point(p)) == p


def test_missing_scikit_optimize_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "skopt", None)
    with pytest.raises(HvdliteConfigError, match="scikit-optimize"):
        autotune.make_optimizer(0.5)


def test_autotuner_measures_steps_and_keeps_the_best(tmp_path):
    """A fake runtime: a step takes 10 ms with a big fusion threshold, 40 ms without."""
    log = tmp_path / "a.csv"
    config = Config(
        autotune=True,
        autotune_warmup_samples=1,
        autotune_steps_per_sample=2,
        autotune_bayes_opt_max_samples=5,
        autotune_log_file=str(log),
    )
    start = Parameters.from_config(config).replace(fusion_threshold_bytes=2 << 20)
    switched = threading.Event()
    tuner = None

    def propose(**changes):
        tuner.parameters(0, Parameters(**changes))  # the switch, as the runtime reports it
        switched.set()
        return Parameters(**changes)

    retired = threading.Event()
    tuner = autotune.Autotuner(config, propose, start, on_finish=retired.set)
    now, params = 0.0, start
    for _ in range(400):
        if tuner.finished.is_set():
            break
        params = tuner._current
        step = 0.01 if params.fusion_threshold_bytes >= 32 << 20 else 0.04
        for i in range(4):
            now += step / 4
            tuner.queued(f"t{i}", "allreduce", now, 1000)
            tuner.done(f"t{i}", now, None)
        time.sleep(0.002)  # let the decision thread think
    assert tuner.finished.wait(10), "the tuner never finished"
    assert retired.wait(5), "the tuner did not ask to stop receiving events"
    tuner.close()
    kinds = [s[0] for s in tuner.samples]
    assert kinds == ["warmup", "initial"] + ["bayes"] * 5 + ["confirm"] * 3
    initial = [s[5] for s in tuner.samples if s[0] == "initial"][0]
    best = max(s[5] for s in tuner.samples if s[1] == tuner.best)
    assert best >= initial and tuner.best.fusion_threshold_bytes >= 32 << 20, tuner.samples
    assert log.read_text().count("\n") == 1 + len(tuner.samples) + 1


def test_summary_tool_needs_no_framework_launcher_or_plotting_to_start():
    """The summary runs wherever the trace was copied: no torch, no launcher, matplotlib
    and scikit-optimize only when asked for."""
    import subprocess

    code = (
        "import sys, hvdlite.timeline, hvdlite.timeline.__main__; "
        "print(sorted(m.split('.')[0] for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'matplotlib', 'skopt') "
        "or m.startswith('hvdlite.runner')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_second_init_of_a_process_writes_a_new_file(tmp_path, monkeypatch):
    from hvdlite.common.diagnostics import observers

    monkeypatch.setattr(observers, "_CONFIGURED_PATHS", {})
    path = str(tmp_path / "trace.json")
    assert [observers._fresh_path(path) for _ in range(3)] == [
        path,
        str(tmp_path / "trace.1.json"),
        str(tmp_path / "trace.2.json"),
    ]
