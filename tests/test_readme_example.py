"""The README's example, run as a user would (hvdlite-run -np 2): it visibly learns."""

import os
import re
import sys

import pytest

from tests import launching

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Example\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.timeout(180)
def test_the_readme_example_learns(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_example())
    r = launching.run(["-np", "2", sys.executable, script], timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [
        float(x) for x in re.findall(r"^\[0\]<stdout>:epoch \d: loss ([\d.]+)$", r.stdout, re.M)
    ]
    assert len(losses) == 5, r.stdout
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 2, losses
