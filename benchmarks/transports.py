#!/usr/bin/env python
"""hvdlite's transports side by side: shared memory, Gloo's TCP loopback, MPI.

Runs ``allreduce.py`` in several launches of one invocation and puts the results in
one table, each hvdlite number as a ratio to the baselines measured in the same launch: the
concurrent-memcpy floor (every rank copying its own bytes at once), one flat raw
``torch.distributed`` Gloo allreduce of all the bytes, and one Gloo allreduce per tensor::

    .venv/bin/python benchmarks/transports.py [--np 2,4] [--workloads resnet50,bert,tiny1000]
        [--bert-layers 12] [--rounds 2] [--ssh-port P --ssh-identity FILE] [--json FILE]

Launches per ``np``: Gloo mode (``hvdlite_fusion`` over shared memory, ``hvdlite_noshm``
over TCP, and the raw baselines) and ``--mpi`` mode (``hvdlite_fusion`` over MPICH, whose
own transport between local ranks is shared memory, plus the raw baselines).  With
``--ssh-port`` also a 2 hosts x 2 ranks Gloo launch over ``-H 127.0.0.1:2,127.0.0.2:2``
(an sshd must listen on both loopback addresses): the hierarchical path.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def launch(np_, mode, workloads, impls, rounds, bert_layers, steps=(), hosts=None, ssh=()):
    """One allreduce.py launch; returns its JSON rows, or raises with its output."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "hvdlite.runner.cli.launch", "-np", str(np_)]
        if mode == "mpi":
            cmd.append("--mpi")
        if hosts:
            cmd += ["-H", hosts, *ssh]
        cmd += [
            sys.executable,
            os.path.join(HERE, "allreduce.py"),
            "--workloads",
            ",".join(workloads),
            "--impls",
            ",".join(impls),
            "--rounds",
            str(rounds),
            "--bert-layers",
            str(bert_layers),
            "--json",
            out,
            *steps,
        ]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                f"{(proc.stdout + proc.stderr)[-3000:]}"
            )
        with open(out) as f:
            return json.load(f)["rows"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", default="2,4", help="comma-separated world sizes on this host")
    p.add_argument("--workloads", default="resnet50,bert,tiny1000")
    p.add_argument("--bert-layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ssh-port", type=int, help="also run 2 hosts x 2 ranks over this sshd")
    p.add_argument("--ssh-identity", help="private key for --ssh-port")
    p.add_argument("--iters", type=int, help="timed steps per cell (allreduce.py's default)")
    p.add_argument("--warmup", type=int, help="warm-up steps per cell")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    steps = [
        f"--{k}={v}" for k, v in (("iters", args.iters), ("warmup", args.warmup)) if v is not None
    ]
    workloads = args.workloads.split(",")
    raw = ["torch_per_tensor", "torch_flat"]
    configs = []
    for n in [int(x) for x in args.np.split(",")]:
        configs.append((f"np={n}, one host", n, "gloo", ["hvdlite_fusion", "hvdlite_noshm"], None))
        configs.append((f"np={n}, one host", n, "mpi", ["hvdlite_fusion"], None))
    if args.ssh_port:
        ssh = ["-p", str(args.ssh_port)] + (["-i", args.ssh_identity] if args.ssh_identity else [])
        configs.append(
            (
                "2 hosts x 2",
                4,
                "gloo",
                ["hvdlite_fusion", "hvdlite_noshm"],
                ("127.0.0.1:2,127.0.0.2:2", ssh),
            )
        )
    results = []
    for label, n, mode, impls, hosts in configs:
        print(f"running {label} {mode} ...", flush=True)
        rows = launch(
            n,
            mode,
            workloads,
            impls + raw,
            args.rounds,
            args.bert_layers,
            steps,
            *(hosts or (None, ())),
        )
        for r in rows:
            r.update(setup=label, mode=mode)
        results.extend(rows)
    table = summarize(results)
    print_table(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "table": table, "argv": sys.argv[1:]}, f, indent=2)


NAMES = {
    ("gloo", "hvdlite_fusion"): "shared memory",
    ("gloo", "hvdlite_noshm"): "Gloo TCP",
    ("mpi", "hvdlite_fusion"): "MPI",
}


def summarize(rows):
    """One line per (setup, workload, transport): ms and ratios to its launch's baselines."""
    base = {}
    for r in rows:
        if r["impl"] in ("torch_flat", "torch_per_tensor", "memcpy_floor"):
            base[(r["setup"], r["mode"], r["workload"], r["impl"])] = r["ms_median"]
    table = []
    for r in rows:
        name = NAMES.get((r["mode"], r["impl"]))
        if name is None:
            continue
        key = (r["setup"], r["mode"], r["workload"])
        flat, per = base[key + ("torch_flat",)], base[key + ("torch_per_tensor",)]
        floor = base[key + ("memcpy_floor",)]
        table.append(
            {
                "setup": r["setup"],
                "workload": r["workload"],
                "transport": name,
                "ms": r["ms_median"],
                "raw_flat_ms": flat,
                "raw_per_tensor_ms": per,
                "floor_ms": floor,
                "x_floor": r["ms_median"] / floor,
                "paired_x_floor": r.get("paired_ratio_to_floor"),
                "x_flat": r["ms_median"] / flat,
                "speedup_vs_per_tensor": per / r["ms_median"],
            }
        )
    return table


def print_table(table):
    print(
        f"\n{'setup':<18} {'workload':<10} {'transport':<14} {'ms':>9} {'floor':>8} "
        f"{'x floor':>7} {'p floor':>7} {'raw flat':>9} {'raw per-t':>10} {'x flat':>7} "
        f"{'vs per-t':>9}"
    )
    for t in table:
        pf = t["paired_x_floor"]
        print(
            f"{t['setup']:<18} {t['workload']:<10} {t['transport']:<14} {t['ms']:9.2f} "
            f"{t['floor_ms']:8.2f} {t['x_floor']:7.2f} {(f'{pf:.2f}' if pf else '-'):>7s} "
            f"{t['raw_flat_ms']:9.2f} {t['raw_per_tensor_ms']:10.2f} {t['x_flat']:7.2f} "
            f"{t['speedup_vs_per_tensor']:8.1f}x"
        )
    print(
        "\nx floor = hvdlite / every rank copying its own bytes at once (same launch; p floor: "
        "the median of per-step ratios to a floor step timed right after each);\nx flat = "
        "hvdlite / one raw Gloo allreduce of all the bytes (same launch); vs per-t = raw Gloo "
        "per-tensor allreduces / hvdlite (same launch)"
    )


if __name__ == "__main__":
    main()
