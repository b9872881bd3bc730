"""Per-rank lateness from a timeline: who the others waited for, how often, how long --
the one definition of waiting that the summary's table and both plots use.

The runtime marks every completing cycle in which one rank was clearly the last to be
ready with a ``LATE`` event (its rank, and how long the others waited: the straggler
report's measure, ``hvdlite.common.diagnostics.stragglers``), on the response cache's fast path too.
A trace without them (written by an older hvdlite) falls back to the negotiation slices'
``waited_for``, which only see a rank that asked a full cycle later than the others.
:func:`report` gives the table and, with ``--plot``, draws it (matplotlib when
installed, else bars of text in the table).
"""

import collections
from typing import Dict, List, Optional, Tuple

from hvdlite.common.diagnostics.timeline_writer import LATE_NAME, NEGOTIATE_PREFIX, load_events

#: the widest text bar
_BAR = 30


def _trace_start_us(events: List[dict]) -> Optional[float]:
    starts = [
        ev["ts"]
        for ev in events
        if isinstance(ev.get("ts"), (int, float))
        and ev.get("ph") in ("X", "i")
        and ev.get("name") != LATE_NAME
    ]
    return min(starts) if starts else None


def _is_startup(ev: dict, start_us: Optional[float]) -> bool:
    """A ``LATE`` mark whose wait began before the trace did: the job's start-up skew (one
    rank still importing or building its model when the others reached the first
    collective), not a straggler.  (A mark is written one agreement after the cycle it
    measures, so it cannot be told by its place alone.)"""
    if start_us is None:
        return False
    waited_us = float((ev.get("args") or {}).get("ms", 0.0)) * 1e3
    return waited_us > ev.get("ts", 0.0) - start_us


def startup_wait(events: List[dict]) -> Optional[Tuple[int, float]]:
    """``(rank, seconds the others waited for it)`` at the job's first collective, when
    one rank came clearly last to it; not counted in :func:`lateness`."""
    start = _trace_start_us(events)
    for ev in events:
        if ev.get("ph") == "i" and ev.get("name") == LATE_NAME and _is_startup(ev, start):
            args = ev.get("args") or {}
            return int(args.get("rank", -1)), float(args.get("ms", 0.0)) / 1e3
    return None


def lateness(events: List[dict]) -> Tuple[str, Dict[int, Tuple[int, float]], float]:
    """``(source, {rank: (times it was last, seconds the others waited)}, trace seconds)``;
    source is ``"LATE events"`` or ``"negotiations"``.  The start-up skew at the first
    collective (:func:`startup_wait`) is left out."""
    marks: Dict[int, List[float]] = collections.defaultdict(lambda: [0, 0.0])
    waits: Dict[int, List[float]] = collections.defaultdict(lambda: [0, 0.0])
    first, last = None, None
    start = _trace_start_us(events)
    for ev in events:
        ts = ev.get("ts")
        if isinstance(ts, (int, float)) and ev.get("ph") in ("X", "i"):
            first = ts if first is None else min(first, ts)
            last = ts + ev.get("dur", 0.0) if last is None else max(last, ts + ev.get("dur", 0.0))
        name = str(ev.get("name", ""))
        args = ev.get("args") or {}
        if ev.get("ph") == "i" and name == LATE_NAME:
            if _is_startup(ev, start):
                continue
            marks[int(args.get("rank", -1))][0] += 1
            marks[int(args.get("rank", -1))][1] += float(args.get("ms", 0.0)) / 1e3
        elif ev.get("ph") == "X" and name.startswith(NEGOTIATE_PREFIX):
            for r in args.get("waited_for", ()):
                waits[int(r)][0] += 1
                waits[int(r)][1] += ev.get("dur", 0.0) / 1e6
    span = (last - first) / 1e6 if first is not None and last is not None else 0.0
    source, per = ("LATE events", marks) if marks else ("negotiations", waits)
    return source, {r: (int(c), s) for r, (c, s) in per.items()}, span


def format_table(source: str, per: Dict[int, Tuple[int, float]], span_s: float, bars: bool) -> str:
    """The lateness table, latest rank first; ``bars`` adds a text bar of the time."""
    if not per:
        return "per-rank lateness: no rank kept the others waiting in this trace"
    lines = [
        f"ranks waited for (from {source}): a rank is late in a cycle when it was "
        f"ready last; 'waited ms' is how long the others waited for it then",
        f"  {'rank':>5s} {'cycles late':>11s} {'waited ms':>10s} {'ms per cycle':>12s} "
        f"{'% of trace span':>15s}",
    ]
    top = max(s for _, s in per.values()) or 1.0
    for r, (count, secs) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        bar = " " + "#" * max(1, round(_BAR * secs / top)) if bars else ""
        share = f"{100.0 * secs / span_s:>14.1f}%" if span_s > 0 else f"{'-':>15s}"
        lines.append(
            f"  {r:>5d} {count:>11d} {1e3 * secs:>10.2f} "
            f"{1e3 * secs / max(count, 1):>12.2f} {share}{bar}"
        )
    return "\n".join(lines)


def plot(per: Dict[int, Tuple[int, float]], path: str) -> bool:
    """Bars of the time each rank was waited for, as a PNG; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(per)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(ranks) + 2), 3.5))
    ax.bar([str(r) for r in ranks], [1e3 * per[r][1] for r in ranks], color="#d1495b")
    ax.set_xlabel("rank")
    ax.set_ylabel("ms the others waited for it")
    ax.set_title("per-rank lateness")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def report(trace: str, summary_plot: Optional[str] = None) -> str:
    """The lateness section of ``python -m hvdlite.timeline summary``; with the summary's
    ``--plot FILE.png`` also draws ``FILE-lateness.png`` (text bars without matplotlib)."""
    events = load_events(trace)
    source, per, span = lateness(events)
    start = startup_wait(events)
    note = (
        ""
        if start is None
        else (
            f"\nat the first collective the others waited {1e3 * start[1]:.2f} ms for rank "
            f"{start[0]} (start-up: a rank still importing or building its model; not counted "
            f"above)"
        )
    )
    return _table_and_plot(source, per, span, summary_plot) + note


def _table_and_plot(
    source: str, per: Dict[int, Tuple[int, float]], span: float, summary_plot: Optional[str]
) -> str:
    if summary_plot and per:
        stem = summary_plot[:-4] if summary_plot.lower().endswith(".png") else summary_plot
        path = stem + "-lateness.png"
        if plot(per, path):
            return format_table(source, per, span, False) + f"\nlateness plot written to {path}"
        return format_table(source, per, span, True) + "\n(matplotlib is not installed: text bars)"
    return format_table(source, per, span, False)
