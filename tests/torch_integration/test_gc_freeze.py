"""init() puts the objects alive at that moment out of the garbage collector's reach (so
the full passes that a busy step's per-op objects trigger stay short), unless the launcher's
--no-gc-freeze says otherwise; either way the job's results are the same."""

import re

import pytest

from tests.torch_integration.conftest import launch

SCRIPT = """
import gc, torch, hvdlite.torch as hvd
before = gc.get_freeze_count()
hvd.init()
total = hvd.allreduce(torch.ones(3) * (hvd.rank() + 1), op=hvd.Sum)
print(f"FROZEN rank={hvd.rank()} before={before} after={gc.get_freeze_count()} "
      f"sum={total.tolist()}")
hvd.shutdown()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags, frozen", [((), True), (("--no-gc-freeze",), False)], ids=["default", "no-gc-freeze"]
)
def test_init_freezes_the_collector_unless_told_not_to(tmp_path, flags, frozen):
    script = tmp_path / "gc_worker.py"
    script.write_text(SCRIPT)
    rc, out = launch(script, launcher_args=flags)
    assert rc == 0, out
    rows = re.findall(r"FROZEN rank=(\d) before=(\d+) after=(\d+) sum=(\[.*\])", out)
    assert sorted(r[0] for r in rows) == ["0", "1"], out
    for _, before, after, total in rows:
        assert before == "0" and total == "[3.0, 3.0, 3.0]"
        # torch alone brings tens of thousands of objects
        assert (int(after) > 10_000) if frozen else (after == "0"), (flags, after)
