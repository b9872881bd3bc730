#!/usr/bin/env python
"""Launch latency: how long a job of two ranks takes from the command to its exit.

    python benchmarks/launch.py [--np 2] [--repeats 5] [--json FILE]

Each row launches ``--np`` ranks of a tiny program and times the whole command; rows are
interleaved repeat by repeat so machine noise hits them alike, and every row is shown as a
ratio to torchrun's launch of the same work in the same run:

* ``noop``   the ranks run ``pass``: the launcher's own cost (``hvdlite-run`` against
  ``torchrun``; ``python x np`` is the same processes started by a shell, no launcher);
* ``init``   the ranks import the framework and meet once: ``hvdlite.torch`` with
  ``hvd.init()`` and one allreduce, against ``torchrun`` with ``init_process_group("gloo")``
  and one ``all_reduce``.

Both launchers run on this host only (no SSH).  The machine's load average is printed
before and after: absolute times move between machines, the ratios much less.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HVDLITE_INIT = """
import torch, hvdlite.torch as hvd
hvd.init()
t = torch.ones(4)
hvd.allreduce_(t, name="t")
assert t[0].item() == 1.0
"""

TORCH_INIT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
dist.destroy_process_group()
"""


def commands(np_: int, folder: str) -> dict:
    """``(work, launcher)`` -> the command line of that row (torchrun's is each work's baseline)."""
    py = sys.executable
    bindir = os.path.dirname(py)
    hvdlite_run = shutil.which("hvdlite-run", path=bindir) or "hvdlite-run"
    torchrun = shutil.which("torchrun", path=bindir) or "torchrun"
    scripts = {}
    for name, text in (
        ("noop", "pass\n"),
        ("hvdlite_init", HVDLITE_INIT),
        ("torch_init", TORCH_INIT),
    ):
        path = os.path.join(folder, name + ".py")
        with open(path, "w") as f:
            f.write(text)
        scripts[name] = path
    torchrun_args = [torchrun, "--standalone", f"--nproc-per-node={np_}"]
    shell = " & ".join([f"{py} {scripts['noop']}"] * np_) + "; wait"
    return {
        ("noop", "torchrun"): torchrun_args + [scripts["noop"]],
        ("noop", "hvdlite-run"): [hvdlite_run, "-np", str(np_), py, scripts["noop"]],
        ("noop", "python x np"): ["sh", "-c", shell],
        ("init", "torchrun"): torchrun_args + [scripts["torch_init"]],
        ("init", "hvdlite-run"): [hvdlite_run, "-np", str(np_), py, scripts["hvdlite_init"]],
    }


def time_once(argv) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({proc.returncode}):\n"
            f"{proc.stdout.decode(errors='replace')[-3000:]}"
        )
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="hvdlite-launch-") as folder:
        cmds = commands(args.np, folder)
        times = {key: [] for key in cmds}
        for key, argv in cmds.items():  # one untimed warm-up each
            time_once(argv)
        for _ in range(args.repeats):
            for key, argv in cmds.items():
                times[key].append(time_once(argv))
    rows = []
    for (group, launcher), ts in times.items():
        median = statistics.median(ts)
        base = statistics.median(times[(group, "torchrun")])
        rows.append(
            {
                "work": group,
                "launcher": launcher,
                "s_median": median,
                "s_min": min(ts),
                "x_torchrun": median / base,
                "repeats": len(ts),
            }
        )
    print(
        f"np={args.np}, {args.repeats} launches per row (interleaved), median seconds from "
        f"the command to its exit"
    )
    print(f"{'work':6} {'launcher':12} {'median s':>9} {'min s':>7} {'x torchrun':>11}")
    for r in rows:
        print(
            f"{r['work']:6} {r['launcher']:12} {r['s_median']:9.2f} {r['s_min']:7.2f} "
            f"{r['x_torchrun']:11.2f}"
        )
    load_after = os.getloadavg()[0]
    print(
        f"machine load (1-min average) {load_before:.2f} before, {load_after:.2f} after, "
        f"{os.cpu_count()} cores"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "meta": {
                        "np": args.np,
                        "repeats": args.repeats,
                        "load_before": load_before,
                        "load_after": load_after,
                    },
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
