"""Zero-copy gradient buckets (``--zero-copy``, the default): DistributedOptimizer's buckets
live in the host's shared bucket arena and are reduced where they lie.  They must give the
same bits as the copying path, with and without compression, on 2 and 4 local ranks, with
buckets of one piece and of many, and after an elastic reset (a new round maps the arenas
again).  One launch runs several trainings one after another (the runtime restarted in
between), so the comparison costs few launches."""

import pytest
import torch

from tests.torch_integration.conftest import WORKERS, launch

pytestmark = pytest.mark.timeout(300)

SCRIPT = WORKERS / "zero_copy_train.py"


def run(tmp_path, tag, np=2, env=None, launcher_args=()):
    out = tmp_path / tag
    out.mkdir()
    rc, output = launch(
        SCRIPT,
        np=np,
        env={"ZC_OUT": str(out), **(env or {})},
        timeout_s=200,
        launcher_args=launcher_args,
    )
    assert rc == 0, output[-5000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(np)], output


def assert_same_bits(a, b, what):
    for key in ("params", "momentum"):
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert torch.equal(x, y), (
                f"{what}: {key}[{i}] differs by {(x - y).abs().max().item():.3g}"
            )


def check_zero_copy_run(shared, copied, what):
    """``shared`` used the arena for every bucket and reduced all of them zero-copy;
    ``copied`` none."""
    assert len(shared["shared"]) >= 2 and all(shared["shared"]), what
    assert sum(no for no, _ in shared["zero_copy"].values()) == 0, (what, shared["zero_copy"])
    assert sum(yes for _, yes in shared["zero_copy"].values()) >= 6, (what, shared["zero_copy"])
    assert not any(copied["shared"]) and not copied["zero_copy"], what


RUNS = "1:none,0:none,1:fp16,0:fp16,1:none:small,0:none:small"


@pytest.mark.parametrize("np", [2, 4])
def test_zero_copy_buckets_give_the_copying_paths_bits(tmp_path, np):
    ranks, _ = run(tmp_path, "runs", np, {"ZC_RUNS": RUNS if np == 2 else "1:none,0:none"})
    for r, runs in enumerate(ranks):
        for on, off in [
            ("1:none", "0:none"),
            ("1:fp16", "0:fp16"),
            ("1:none:small", "0:none:small"),
        ]:
            if on not in runs:
                continue
            what = f"rank {r}, {on} against {off}"
            assert_same_bits(runs[on], runs[off], what)
            assert_same_bits(runs[on], ranks[0][on], f"rank {r} against rank 0, {on}")
            if "fp16" in on:
                # compressed buckets are reduced as a copy: none is placed in the arena
                assert not any(runs[on]["shared"]) and not runs[on]["zero_copy"], what
            else:
                check_zero_copy_run(runs[on], runs[off], what)
    if np == 2:  # the same training, whatever the pieces
        assert_same_bits(ranks[0]["1:none"], ranks[0]["1:none:small"], "pieces")


def test_zero_copy_after_an_elastic_reset_gives_the_copying_paths_bits(tmp_path):
    """Rank 1 raises after its third commit: both ranks restore and meet in round 1, whose
    shared-memory group maps the (unchanged) bucket arenas again and reduces in them."""
    env = {"ZC_ELASTIC": "1", "ZC_STEPS": "8"}
    hosts = tmp_path / "hosts.sh"
    hosts.write_text("#!/bin/sh\necho localhost:2\n")
    hosts.chmod(0o755)
    flags = (
        "--min-np",
        "2",
        "--max-np",
        "2",
        "--host-discovery-script",
        str(hosts),
        "--fault-at",
        "rank=1,commit=3,action=raise,round=0",
    )
    shared, out = run(tmp_path, "shared", 2, env, ("--zero-copy", *flags))
    copied, _ = run(tmp_path, "copied", 2, env, ("--no-zero-copy", *flags))
    for r in range(2):
        on, off = shared[r]["elastic"], copied[r]["elastic"]
        assert_same_bits(on, off, f"rank {r} after a reset")
        rounds = on["zero_copy"]
        assert len(rounds) >= 2, f"no reset happened: {rounds}\n{out[-3000:]}"
        assert all(yes > 0 and no == 0 for no, yes in rounds.values()), rounds
        check_zero_copy_run(on, off, f"rank {r}")
