#!/usr/bin/env python
"""Training over slow links: time to a target loss for synchronous data parallelism,
compressed gradients and DiLoCo, between two real hosts over shaped links.

Needs root: it builds the namespaced testbed of ``tests/testbed`` (hosts ``tbh0`` and
``tbh1``, two ranks each: shared memory inside a host, TCP over a ``tc tbf``-shaped veth
link between them) and removes it at the end, also on an error, Ctrl-C or SIGTERM::

    python benchmarks/slow_links.py [--rates 100mbit,1gbit] [--methods sync,diloco-h50,...]
        [--target-steps 60] [--budget-factor 1.0] [--json FILE] [--plot FILE.png]

Per rate it first trains ``sync`` (``DistributedOptimizer`` over AdamW) for
``--target-steps`` steps: the validation loss it ends at is the target, and its training
time times ``--budget-factor`` is every other method's budget.  Each other method
(``benchmarks/slow_links_train.py``: PowerSGD rank 4, int8, DiLoCo with H = 10 and 50,
Streaming DiLoCo (5 fragments, overlapped), DiLoCo with an int8 outer exchange) trains from
the same weights on the same batches for that budget.  Rows: the first training time its
validation loss reached the target (``seconds_to_target``, null if never), its loss at the
end of the budget, the bytes its host's link sent per rank per step (the kernel's count of
the testbed interface), and its utilisation (rank 0's forward and backward time over its
training time).  Targets (the issue's): at the slowest rate the best DiLoCo row reaches the
target in <= 0.25 x sync's time, sends >= 20 x fewer bytes per step, at utilisation >= 0.8;
at the fastest rate no method takes more than 1.1 x sync's time to the target.
"""

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (REPO, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

from crosshost import (  # noqa: E402
    _Interrupted,
    _on_sigterm,
    burst_for,
    parse_rates,
    rate_bits,
    run_job,
)
from slow_links_train import METHODS  # noqa: E402

from tests.testbed import Testbed, TestbedUnavailable  # noqa: E402

TRAIN = os.path.join(HERE, "slow_links_train.py")
HOSTS = ["-np", "4", "-H", "tbh0:2,tbh1:2"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="100mbit,1gbit", help="tc rates (default 100mbit,1gbit)")
    p.add_argument("--methods", default=",".join(METHODS), help="methods (sync always runs)")
    p.add_argument("--target-steps", type=int, default=60, help="sync's steps (default 60)")
    p.add_argument("--budget-factor", type=float, default=1.0)
    p.add_argument("--burst", default="auto", help="tc tbf burst (default: crosshost.py's)")
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument(
        "--train-args", default="", help="extra arguments for slow_links_train.py (model size)"
    )
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE", help="loss against time, one panel per rate")
    args = p.parse_args(argv)
    args.rates = parse_rates(p, args.rates)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown} (known: {', '.join(METHODS)})")
    args.methods = ["sync"] + [m for m in args.methods if m != "sync"]
    return args


def first_reaching(curve, target):
    for seconds, _step, loss in curve:
        if loss <= target + 1e-9:
            return seconds
    return None


def row_of(res, rate, target):
    return {
        "method": res["method"],
        "link_mbit": rate_bits(rate) / 1e6,
        "seconds_to_target": first_reaching(res["curve"], target),
        "final_val_loss": res["curve"][-1][2],
        "bytes_per_step": res["bytes_per_step"],
        "utilisation": res["compute_seconds"] / res["train_seconds"],
        "steps": res["steps"],
        "train_seconds": res["train_seconds"],
        "target_loss": target,
        "curve": res["curve"],
    }


def run_rate(tb, args, rate, tmp, log):
    """Every method at ``rate``: sync first (the target and the budget), then the rest."""
    for h in tb.hosts:
        tb.shape(h.name, rate, burst=burst_for(rate, args.burst))
    extra = args.train_args.split()
    rows, target, budget = [], None, None
    for method in args.methods:
        bench = ["--method", method, *extra]
        bench += (
            ["--steps", str(args.target_steps)]
            if method == "sync"
            else ["--budget-s", f"{budget:.3f}"]
        )
        out = os.path.join(tmp, f"{method}_{rate}.json")
        res, took = run_job(
            tb, HOSTS, bench, out, args.job_timeout, args.verbose, log, script=TRAIN
        )
        if method == "sync":
            target = res["curve"][-1][2]
            budget = res["train_seconds"] * args.budget_factor
        rows.append(row_of(res, rate, target))
        r = rows[-1]
        log(
            f"  {rate} {method}: {r['steps']} steps in {r['train_seconds']:.1f} s, loss "
            f"{r['final_val_loss']:.3f} (target {target:.3f}), job {took:.0f} s"
        )
    for h in tb.hosts:
        tb.unshape(h.name)
    return rows


def targets(rows):
    """The issue's pass/fail checks over the rows."""
    rates = sorted({r["link_mbit"] for r in rows})
    out = {}
    by = {(r["link_mbit"], r["method"]): r for r in rows}
    slow, fast = rates[0], rates[-1]
    sync = by.get((slow, "sync"))
    dilocos = [r for r in rows if r["link_mbit"] == slow and r["method"].startswith("diloco")]
    reached = [r for r in dilocos if r["seconds_to_target"] is not None]
    if sync and dilocos:
        best = min(reached, key=lambda r: r["seconds_to_target"]) if reached else dilocos[0]
        time_ratio = best["seconds_to_target"] / sync["seconds_to_target"] if reached else None
        bytes_ratio = sync["bytes_per_step"] / max(best["bytes_per_step"], 1e-9)
        out[f"{slow:g}mbit_best_diloco"] = best["method"]
        out[f"{slow:g}mbit_time_to_target_ratio"] = _check(time_ratio, lambda v: v <= 0.25)
        out[f"{slow:g}mbit_fewer_bytes_x"] = _check(bytes_ratio, lambda v: v >= 20)
        out[f"{slow:g}mbit_utilisation"] = _check(best["utilisation"], lambda v: v >= 0.8)
    fsync = by.get((fast, "sync"))
    if fsync and len(rates) > 1:
        worst = [
            (r["seconds_to_target"] or math.inf) / fsync["seconds_to_target"]
            for r in rows
            if r["link_mbit"] == fast and r["method"] != "sync"
        ]
        if worst:
            out[f"{fast:g}mbit_slowest_to_target_ratio"] = _check(max(worst), lambda v: v <= 1.1)
    return out


def _check(value, ok):
    return {"value": value, "met": value is not None and bool(ok(value))}


def _fmt(v, spec):
    return "—" if v is None else format(v, spec)


def print_table(rows, tgts):
    print()
    head = "| link | method | steps | s to target | x sync | final loss | bytes/step | x fewer | util |"
    print(head)
    print("|" + "---|" * 9)
    sync = {r["link_mbit"]: r for r in rows if r["method"] == "sync"}
    for r in rows:
        s = sync[r["link_mbit"]]
        x = (
            None
            if r["seconds_to_target"] is None
            else r["seconds_to_target"] / s["seconds_to_target"]
        )
        fewer = s["bytes_per_step"] / max(r["bytes_per_step"], 1e-9)
        print(
            f"| {r['link_mbit']:g} Mbit/s | {r['method']} | {r['steps']} | "
            f"{_fmt(r['seconds_to_target'], '.1f')} | {_fmt(x, '.2f')} | "
            f"{r['final_val_loss']:.3f} | {r['bytes_per_step'] / 1e6:.3f} MB | {fewer:.1f} | "
            f"{r['utilisation']:.2f} |"
        )
    print()
    for name, t in tgts.items():
        if isinstance(t, dict):
            print(f"{name}: {_fmt(t['value'], '.3g')} {'met' if t['met'] else 'NOT met'}")
        else:
            print(f"{name}: {t}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r["link_mbit"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for r in rows:
            if r["link_mbit"] == rate:
                ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], label=r["method"])
        target = next(r["target_loss"] for r in rows if r["link_mbit"] == rate)
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set(title=f"{rate:g} Mbit/s", xlabel="training seconds", ylabel="validation loss")
        ax.set_ylim(top=3.5)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    args = parse_args(argv)

    def log(msg):
        print(f"[slow_links] {msg}", file=sys.stderr, flush=True)

    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    tmp = tempfile.mkdtemp(prefix="hvdlite-slow-links-")
    rows, tb, t0 = [], None, time.monotonic()
    try:
        try:
            tb = Testbed(2)
        except TestbedUnavailable as exc:
            print(f"slow_links: {exc}", file=sys.stderr)
            return 2
        for rate in args.rates:
            log(f"2 hosts at {rate} (np=4, -H tbh0:2,tbh1:2)")
            rows += run_rate(tb, args, rate, tmp, log)
    except (KeyboardInterrupt, _Interrupted) as exc:
        print(f"slow_links: interrupted ({exc or 'Ctrl-C'}); removing the testbed", file=sys.stderr)
        return 130
    finally:
        if tb is not None:
            tb.close()
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(tmp, ignore_errors=True)
    tgts = targets(rows)
    print_table(rows, tgts)
    log(f"took {time.monotonic() - t0:.0f} s")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "targets": tgts, "settings": settings}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
