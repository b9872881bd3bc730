"""Run Horovod's own parallel test files against hvdlite, as a drop-in check.

Horovod's ``test/parallel/test_torch.py`` and ``test_tensorflow.py`` are run on every rank
under ``hvdlite-run``: they are copied out of a Horovod checkout into a scratch folder (never
into this repository), their ``horovod`` imports are pointed at ``hvdlite``, and pytest runs on
each rank with a per-test time limit.  Rank 0's JUnit report gives the counts, the failures
and the slowest tests::

    python benchmarks/horovod_suite.py --horovod PATH [--file test_torch.py] [-np 2]
        [--test-timeout 120] [--timeout 1800] [-k EXPR] [--json FILE]

``PATH`` is a Horovod work tree, or a bare git directory (its ``HEAD`` is read with
``git show``).  The run is a check for a developer, not part of the suite: CI has no Horovod.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

#: the files a parallel test imports besides itself (from test/parallel and test/utils)
_HELPERS = {"test_tensorflow.py": ["test/parallel/base_test_tensorflow.py"], "test_torch.py": []}
_UTILS = ["test/utils/common.py"]


def _read(horovod: str, rel: str) -> str:
    path = os.path.join(horovod, rel)
    if os.path.isfile(path):
        with open(path) as f:
            return f.read()
    return subprocess.run(
        ["git", "--git-dir", horovod, "show", f"HEAD:{rel}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


#: Horovod's private helper the TensorFlow test files import at module level (hvdlite has no
#: ``tensorflow.util`` module: it is not API); defined in the copied file instead.  (The
#: ``mock`` package test/utils/common.py imports is the standard library's ``unittest.mock``.)
_PRIVATE_IMPORT = "from horovod.tensorflow.util import _executing_eagerly\n"
_PRIVATE_STANDIN = (
    "def _executing_eagerly():  # Horovod's private helper, as the suite defines it\n"
    "    import tensorflow\n"
    "    return tensorflow.executing_eagerly()\n"
)

#: test/utils/common.py's import of a launcher helper hvdlite has no twin of (its helpers that
#: use it start launchers; the parallel tests never call them): a plain thread instead
_THREADS_IMPORT = "from horovod.runner.util.threads import in_thread\n"
_THREADS_STANDIN = (
    "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
    "    import threading\n"
    "    t = threading.Thread(target=target, args=args, name=name, "
    "daemon=daemon)\n"
    "    t.start()\n"
    "    return t\n"
)


def _point_at_hvdlite(text: str) -> str:
    text = text.replace(_PRIVATE_IMPORT, _PRIVATE_STANDIN)
    text = re.sub(r"^import mock$", "from unittest import mock", text, flags=re.M)
    text = text.replace(_THREADS_IMPORT, _THREADS_STANDIN)
    return re.sub(r"\bhorovod\b(?=[.\s])", "hvdlite", text)


def prepare(horovod: str, name: str, where: str) -> str:
    """Copy the test file and its helpers into ``where`` (parallel/ and utils/ side by
    side, as the file's own ``sys.path`` line expects); returns the test file's path."""
    os.makedirs(os.path.join(where, "parallel"), exist_ok=True)
    os.makedirs(os.path.join(where, "utils"), exist_ok=True)
    for rel in [f"test/parallel/{name}"] + _HELPERS.get(name, []) + _UTILS:
        dest = os.path.join(
            where, "parallel" if "/parallel/" in rel else "utils", os.path.basename(rel)
        )
        with open(dest, "w") as f:
            f.write(_point_at_hvdlite(_read(horovod, rel)))
    return os.path.join(where, "parallel", name)


def summarize(junit: str) -> dict:
    root = ET.parse(junit).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        message = ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (
                    (node.get("message") or "").splitlines()[0][:200] if node.get("message") else ""
                )
                break
        cases.append(
            {
                "name": case.get("name"),
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return {"counts": counts, "cases": cases}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--horovod", required=True, help="a Horovod work tree or bare git dir")
    ap.add_argument("--file", default="test_torch.py", choices=sorted(_HELPERS))
    ap.add_argument("-np", type=int, default=2)
    ap.add_argument("--test-timeout", type=int, default=120, help="seconds per test")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for the whole run")
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args(argv)

    scratch = tempfile.mkdtemp(prefix="hvdlite-horovod-suite-")
    test = prepare(args.horovod, args.file, scratch)
    junit = os.path.join(scratch, "junit-rank0.xml")
    # each rank writes its own report; rank 0's is read
    inner = (
        f"import os, sys, pytest; r = os.environ.get('HOROVOD_RANK', '0'); "
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-o', 'addopts=', "
        f"'--timeout={args.test_timeout}', '--junitxml={scratch}/junit-rank' + r + '.xml', "
        f"{test!r}] + ({['-k', args.k]!r} if {args.k is not None} else [])))"
    )
    cmd = [
        shutil.which("hvdlite-run") or "hvdlite-run",
        "-np",
        str(args.np),
        sys.executable,
        "-c",
        inner,
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=os.path.dirname(test), timeout=args.timeout, capture_output=True, text=True
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = (
            None,
            (e.stdout or b"").decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else (e.stdout or ""),
        )
    wall = time.monotonic() - start
    if not os.path.exists(junit):
        print(out[-6000:])
        print(f"no report from rank 0 (rc {rc}, {wall:.0f} s); scratch folder {scratch}")
        return 1
    result = summarize(junit)
    result.update(file=args.file, np=args.np, rc=rc, wall_s=round(wall, 1))
    c = result["counts"]
    print(
        f"{args.file} at np={args.np}: {c['passed']} passed, {c['failed']} failed, "
        f"{c['skipped']} skipped in {wall:.0f} s (launcher rc {rc})"
    )
    for case in result["cases"]:
        if case["outcome"] == "failed":
            print(f"  FAILED {case['name']} ({case['seconds']:.1f} s): {case['message']}")
    slow = sorted(result["cases"], key=lambda c: -c["seconds"])[:8]
    print("slowest: " + ", ".join(f"{c['name']} {c['seconds']:.1f} s" for c in slow))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
