"""Runs worker scripts under the real launcher (2 ranks) and parses their OK/FAIL lines."""

import re
import sys
from pathlib import Path

import pytest

from tests import launching

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
REPO = HERE.parent.parent


def launch(script, args=(), np=2, timeout_s=150, env=None, launcher_args=()):
    """Run ``script`` on ``np`` ranks through ``hvdlite.runner.cli.launch``; return (rc, output)."""
    proc = launching.run(
        [*launcher_args, "-np", np, sys.executable, script, *args],
        env=env,
        timeout=timeout_s,
        pythonpath=[WORKERS, REPO],
    )
    return proc.returncode, proc.stdout + proc.stderr


class CaseResults:
    """OK/FAIL lines of one launch, by case name and rank."""

    def __init__(self, rc, output, np):
        self.rc, self.output, self.np = rc, output, np
        self.ok = {}
        for m in re.finditer(r"^(?:\[\d+\]<stdout>:)?OK (\S+) rank=(\d+)", output, re.M):
            self.ok.setdefault(m.group(1), set()).add(int(m.group(2)))

    def check(self, case):
        ranks = self.ok.get(case, set())
        if ranks != set(range(self.np)):
            missing = sorted(set(range(self.np)) - ranks)
            pytest.fail(
                f"case {case!r} failed or did not run on rank(s) {missing} "
                f"(launcher exit code {self.rc}); output:\n{self.output[-6000:]}"
            )


def worker_suite(script_name, cases, args=(), env=None, launcher_args=()):
    """The tests of one worker script: one launch shared by the module (a fixture), one test
    per case naming the ranks it failed on, and one for the launcher's exit code.
    ``args`` / ``env`` / ``launcher_args``: for the launch (see :func:`launch`).

    Use as ``results, test_case, test_launch_exit_code = worker_suite(...)`` at module level.
    """

    @pytest.fixture(scope="module")
    def results():
        rc, out = launch(
            WORKERS / script_name, args=args, timeout_s=150, env=env, launcher_args=launcher_args
        )
        return CaseResults(rc, out, np=2)

    @pytest.mark.timeout(180)
    @pytest.mark.parametrize("case", cases)
    def test_case(results, case):
        results.check(case)

    @pytest.mark.timeout(180)
    def test_launch_exit_code(results):
        assert results.rc == 0, results.output[-6000:]

    return results, test_case, test_launch_exit_code
