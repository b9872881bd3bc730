"""Read every rank's flight-recorder dump and say what went wrong: ``hvdlite-doctor DIR``.

Why a reader beside the dumps: one rank's file says what that rank did; a hang or a
mismatch is a disagreement between ranks, visible only side by side.  The doctor
lines the ranks' records up (an operation that completed carries its negotiated cycle,
the same number on every rank of its process set) and prints one finding per line:
the first operation where the ranks disagree (name, op, dtype or shape), the
operations some ranks submitted and others never reached, the operations that never
completed, and which rank arrived last.
"""

import argparse
import collections
import sys
from typing import Dict, List, Optional, Tuple

from hvdlite.common.diagnostics.flight_recorder import dump_files, load

#: ops whose first dimension may differ between ranks
_RAGGED = ("allgather", "alltoall")
_PENDING = ("queued", "negotiated", "in collective")


def _signature(op: dict) -> Tuple:
    shape = op["shape"][1:] if op["op"] in _RAGGED else op["shape"]
    return (op["op"], op["dtype"], tuple(shape))


def _describe(op: dict) -> str:
    return f"{op['op']} {op['dtype']} {list(op['shape'])}"


def _set_ranks(key: str, size: int) -> List[int]:
    if key.startswith("ranks "):
        return [int(r) for r in key[len("ranks ") :].split(",")]
    return list(range(size))


class Job:
    """The dumps of one job, by rank."""

    def __init__(self, dumps: List[dict]):
        self.by_rank: Dict[int, dict] = {}
        for d in dumps:
            old = self.by_rank.get(d["rank"])
            if old is None or d["dumped_at"] > old["dumped_at"]:
                self.by_rank[d["rank"]] = d
        self.size = max([d["size"] for d in dumps] or [0])

    def ops(self, rank: int) -> List[dict]:
        return self.by_rank[rank]["ops"]

    def wrapped(self, rank: int) -> bool:
        d = self.by_rank[rank]
        return d["appended"] > d["capacity"]


def _completed_by_key(job: Job) -> Dict[Tuple, Dict[int, dict]]:
    """(process set, name, cycle) -> rank -> record, for records that got a cycle."""
    out: Dict[Tuple, Dict[int, dict]] = collections.defaultdict(dict)
    for rank in job.by_rank:
        for op in job.ops(rank):
            if op["cycle"] >= 0:
                out[(op["process_set"], op["name"], op["cycle"])][rank] = op
    return out


def _mismatch_findings(job: Job, keyed) -> List[str]:
    """Each operation the ranks submitted with different op / dtype / shape, first first."""
    found = []
    for key, recs in keyed.items():
        if len({_signature(r) for r in recs.values()}) > 1:
            found.append((min(r["submitted"] for r in recs.values()), key, recs))
    lines = []
    for i, (_, (pset, name, cycle), recs) in enumerate(sorted(found, key=lambda f: f[0])):
        what = ", ".join(f"rank {r} {_describe(op)}" for r, op in sorted(recs.items()))
        head = "first divergence" if i == 0 else "divergence"
        lines.append(
            f"{head}: tensor {name!r} (process set {pset}, cycle {cycle}) was "
            f"submitted differently: {what}"
        )
        lines.append(_last_arrival(name, recs))
    return lines


def _last_arrival(name: str, recs: Dict[int, dict]) -> str:
    times = sorted((op["submitted"], r) for r, op in recs.items())
    if len(times) < 2:
        return f"only rank {times[0][1]} has a record of {name!r}"
    (first, r0), (last, r1) = times[0], times[-1]
    return (
        f"last to arrive at {name!r}: rank {r1}, {last - first:.3f} s after rank {r0} "
        f"(wall clocks of the ranks' hosts)"
    )


def _unmatched(job: Job, rank: int, pset: str, name: str, done_cycles) -> List[dict]:
    """``rank``'s records of ``name`` that are not one of the completed instances."""
    return [
        op
        for op in job.ops(rank)
        if op["process_set"] == pset
        and op["name"] == name
        and not (op["state"] == "done" and op["cycle"] in done_cycles)
    ]


def _missing_findings(job: Job) -> Tuple[List[str], List[Tuple[float, str]]]:
    """Operations some ranks submitted and others never reached, and the ones that never
    completed; returns (lines, [(submitted, line)] of the never-completed ones)."""
    found, stuck = [], []
    seen = set()
    for rank in sorted(job.by_rank):
        for op in job.ops(rank):
            if op["state"] == "done":
                continue
            pset, name = op["process_set"], op["name"]
            key = (pset, name)
            state = op["state"] + (f" ({op['error']})" if op["error"] else "")
            stuck.append(
                (
                    op["submitted"],
                    f"never completed: tensor {name!r} "
                    f"({_describe(op)}, process set {pset}) on rank {rank}: {state} "
                    f"after {op['duration_s']:.3f} s",
                )
            )
            if key in seen:
                continue
            seen.add(key)
            found.append((op["submitted"], _who_never_reached(job, rank, op)))
    found.sort(key=lambda f: f[0])
    return [line for _, group in found for line in group], stuck


def _who_never_reached(job: Job, rank: int, op: dict) -> List[str]:
    pset, name = op["process_set"], op["name"]
    done_cycles = {
        o["cycle"]
        for o in job.ops(rank)
        if o["name"] == name and o["process_set"] == pset and o["state"] == "done"
    }
    have, never, unknown = [], [], []
    for peer in _set_ranks(pset, job.size):
        if peer not in job.by_rank:
            unknown.append(peer)
        elif _unmatched(job, peer, pset, name, done_cycles):
            have.append(peer)
        elif (
            job.wrapped(peer) and job.ops(peer) and job.ops(peer)[0]["submitted"] > op["submitted"]
        ):
            unknown.append(peer)  # its ring no longer reaches back that far
        else:
            never.append(peer)
    lines = []
    if never:
        lines.append(
            f"missing op: tensor {name!r} ({_describe(op)}, process set {pset}) "
            f"was submitted by ranks {have} but never by ranks {never}"
        )
        for peer in never:
            lines.append(f"rank {peer} was instead at: {_last_op(job, peer)}")
    if unknown:
        lines.append(
            f"tensor {name!r}: no record to tell whether ranks {unknown} reached it "
            f"(no dump, or their ring had wrapped)"
        )
    return lines


def _last_op(job: Job, rank: int) -> str:
    ops = job.ops(rank)
    if not ops:
        return "no operation recorded"
    pending = [o for o in ops if o["state"] != "done"]
    o = pending[0] if pending else ops[-1]
    return f"tensor {o['name']!r} ({_describe(o)}), {o['state']}"


def _lateness(job: Job, keyed) -> Optional[str]:
    counts: "collections.Counter[int]" = collections.Counter()
    total = 0
    for recs in keyed.values():
        any_rec = next(iter(recs.values()))
        if any_rec["state"] != "done":
            continue
        total += 1
        for r in any_rec["waited_for"]:
            counts[r] += 1
    if not counts:
        return None
    r, n = counts.most_common(1)[0]
    return (
        f"rank {r} was the last to submit in {n} of {total} completed operations "
        f"(all ranks: {dict(sorted(counts.items()))})"
    )


def diagnose(dumps: List[dict]) -> List[str]:
    """The findings, one line each, most telling first."""
    if not dumps:
        return ["no flight-recorder dumps given"]
    job = Job(dumps)
    first = dumps[0]
    lines = [
        f"read {len(job.by_rank)} dumps of job {first['job_id']} (size {job.size}): "
        + "; ".join(
            f"rank {r} on {d['hostname']} pid {d['pid']}: {d['reason']}"
            for r, d in sorted(job.by_rank.items())
        )
    ]
    absent = [r for r in range(job.size) if r not in job.by_rank]
    if absent:
        lines.append(
            f"no dump from ranks {absent} (they exited cleanly, were killed, or "
            f"wrote on another host)"
        )
    keyed = _completed_by_key(job)
    lines += _mismatch_findings(job, keyed)
    missing, stuck = _missing_findings(job)
    if missing and missing[0].startswith("missing op") and len(lines) == 1 + bool(absent):
        missing[0] = "first divergence: " + missing[0]
    lines += missing
    lines += [line for _, line in sorted(stuck)[:10]]
    if len(stuck) > 10:
        lines.append(f"... {len(stuck) - 10} more operations never completed")
    if len(lines) == 1 + bool(absent):
        lines.append("no divergence found: every rank's operations agree and completed")
    late = _lateness(job, keyed)
    if late:
        lines.append(late)
    return lines


def main(argv=None) -> int:
    """``hvdlite-doctor DIR_OR_FILES...``; returns 2 when nothing could be read."""
    p = argparse.ArgumentParser(
        prog="hvdlite-doctor",
        description="Diagnose a failed or hung hvdlite job from its ranks' flight-recorder "
        "dumps (flight-rank<R>.json).",
    )
    p.add_argument("paths", nargs="+", help="dump directories or files")
    args = p.parse_args(argv)
    dumps = []
    for path in dump_files(args.paths):
        try:
            dumps.append(load(path))
        except (OSError, ValueError) as exc:
            print(f"hvdlite-doctor: {exc}", file=sys.stderr)
    if not dumps:
        print(
            f"hvdlite-doctor: no flight-recorder dumps in {' '.join(args.paths)}", file=sys.stderr
        )
        return 2
    print("\n".join(diagnose(dumps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
