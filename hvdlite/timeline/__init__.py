"""Read a timeline file and say where the time went: ``python -m hvdlite.timeline summary``.

Why a summary beside the trace viewer: a trace of thousands of tensors is hard to read
by eye; per tensor and in total, the time in each phase and which ranks everybody
waited for answer "is it the network, the copies, or a slow rank?" at once.
"""

import collections
from typing import Dict, List

from hvdlite.common.diagnostics.timeline_writer import (COPY_IN_NAME, COPY_OUT_NAME, NEGOTIATE_PREFIX,
                                            QUEUED_NAME, load_events, rotated_paths)
from hvdlite.timeline import lateness

#: the phases a summary reports, in the order a tensor passes them
PHASES = ("queued", "negotiate", "copy_in", "collective", "copy_out")


class Summary:
    """Seconds per tensor and phase, operation counts, and waits per rank."""

    def __init__(self):
        self.phase_s: Dict[str, Dict[str, float]] = collections.defaultdict(
            lambda: dict.fromkeys(PHASES, 0.0))
        self.op_s: Dict[str, float] = collections.defaultdict(float)
        self.ops: Dict[str, int] = collections.defaultdict(int)
        self.fused_ops: Dict[str, int] = collections.defaultdict(int)
        #: rank -> [cycles it was late in, seconds the others waited for it]: the lateness
        #: table's measure (``lateness.lateness``)
        self.waited: Dict[int, List[float]] = collections.defaultdict(lambda: [0, 0.0])
        self.cycles = 0
        self.parameter_changes = 0
        self.span_s = 0.0
        #: files read (a rotated timeline has several)
        self.files = 1

    def total(self) -> Dict[str, float]:
        out = dict.fromkeys(PHASES, 0.0)
        for phases in self.phase_s.values():
            for k, v in phases.items():
                out[k] += v
        return out

    def ranked(self) -> List[str]:
        """Tensor names, most time first (negotiation to completion, plus queueing)."""
        return sorted(self.phase_s, key=lambda n: -(self.op_s[n] + sum(self.phase_s[n].values())))


def _phase(ev: dict) -> str:
    name = ev.get("name", "")
    if name == QUEUED_NAME:
        return "queued"
    if name.startswith(NEGOTIATE_PREFIX):
        return "negotiate"
    if name == COPY_IN_NAME:
        return "copy_in"
    if name == COPY_OUT_NAME:
        return "copy_out"
    if "chunk" in (ev.get("args") or {}):
        return "collective"
    return "op"


def summarize(events: List[dict]) -> Summary:
    rows = {e["tid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("tid", 0) > 0}
    s = Summary()
    first, last = None, None
    for ev in events:
        ph = ev.get("ph")
        if ph == "i":
            if ev.get("name") == "CYCLE_START":
                s.cycles += 1
            elif ev.get("name") == "PARAMETERS":
                s.parameter_changes += 1
            continue
        if ph != "X":
            continue
        tensor = rows.get(ev.get("tid"))
        if tensor is None:
            continue
        dur = ev.get("dur", 0.0) / 1e6
        ts = ev.get("ts", 0.0) / 1e6
        first = ts if first is None else min(first, ts)
        last = ts + dur if last is None else max(last, ts + dur)
        phase = _phase(ev)
        if phase == "op":
            s.op_s[tensor] += dur
            s.ops[tensor] += 1
            continue
        s.phase_s[tensor][phase] += dur
        args = ev.get("args") or {}
        if phase == "collective" and args.get("fused"):
            s.fused_ops[tensor] += 1
    s.span_s = (last - first) if first is not None else 0.0
    _, per, _ = lateness.lateness(events)       # the lateness table's own measure
    for r, (count, secs) in per.items():
        s.waited[r] = [count, secs]
    return s


def format_summary(s: Summary, top: int = 20) -> str:
    lines = []
    names = s.ranked()
    lines.append(f"{len(names)} tensors, {sum(s.ops.values())} operations over "
                 f"{s.span_s:.3f} s of trace"
                 + (f", {s.cycles} cycles marked" if s.cycles else "")
                 + (f", {s.parameter_changes} parameter changes" if s.parameter_changes else "")
                 + (f", read from {s.files} rotated files" if s.files > 1 else ""))
    head = (f"{'tensor':<40s} {'ops':>5s} {'fused':>5s} " +
            " ".join(f"{p + ' ms':>14s}" for p in PHASES) + f" {'op ms':>10s}")
    lines.append(head)
    lines.append("-" * len(head))
    for n in names[:top]:
        ph = s.phase_s[n]
        label = n if len(n) <= 40 else n[:18] + ".." + n[-20:]
        lines.append(f"{label:<40s} {s.ops[n]:>5d} {s.fused_ops[n]:>5d} " +
                     " ".join(f"{1e3 * ph[p]:>14.2f}" for p in PHASES) +
                     f" {1e3 * s.op_s[n]:>10.2f}")
    if len(names) > top:
        lines.append(f"... {len(names) - top} more tensors (--top N shows more)")
    tot = s.total()
    lines.append("-" * len(head))
    lines.append(f"{'total':<40s} {sum(s.ops.values()):>5d} {sum(s.fused_ops.values()):>5d} " +
                 " ".join(f"{1e3 * tot[p]:>14.2f}" for p in PHASES) +
                 f" {1e3 * sum(s.op_s.values()):>10.2f}")
    lines.append("")
    return "\n".join(lines)


def plot_summary(s: Summary, path: str, top: int = 20) -> None:
    """Phase time per tensor (stacked bars) and waits per rank, as a PNG.

    Raises:
        ImportError: matplotlib is not installed (the message names the extra).
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot draws with matplotlib, which is not installed: "
                          "pip install matplotlib (or pip install 'hvdlite[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = s.ranked()[:top][::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.32 * len(names) + 1.5)),
                                   gridspec_kw={"width_ratios": [3, 1]})
    left = [0.0] * len(names)
    colors = {"queued": "#bbbbbb", "negotiate": "#f2a541", "copy_in": "#5b8def",
              "collective": "#d1495b", "copy_out": "#66a182"}
    for p in PHASES:
        vals = [1e3 * s.phase_s[n][p] for n in names]
        ax1.barh(range(len(names)), vals, left=left, color=colors[p], label=p)
        left = [a + b for a, b in zip(left, vals)]
    ax1.set_yticks(range(len(names)))
    ax1.set_yticklabels([n if len(n) <= 32 else n[:14] + ".." + n[-16:] for n in names],
                        fontsize=7)
    ax1.set_xlabel("ms in the trace")
    ax1.set_title(f"where each tensor's time went (top {len(names)} of {len(s.phase_s)})")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08 - 1.0 / max(4, len(names))),
               ncol=len(PHASES), fontsize=8)
    ranks = sorted(s.waited)
    ax2.bar([str(r) for r in ranks], [1e3 * s.waited[r][1] for r in ranks], color="#f2a541")
    ax2.set_xlabel("rank")
    ax2.set_ylabel("ms the others waited for it")
    ax2.set_title("who was waited for")
    if not ranks:
        ax2.text(0.5, 0.5, "nobody: all ranks\nasked together", ha="center", va="center",
                 transform=ax2.transAxes)
        ax2.set_xticks([])
        ax2.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_of_file(path: str) -> Summary:
    """The summary of a timeline file and of its rotated older parts (``path.1``, ...),
    which share its rows and time origin."""
    paths = rotated_paths(path) or [path]
    events: List[dict] = []
    for p in paths:
        events += load_events(p)
    s = summarize(events)
    s.files = len(paths)
    return s
