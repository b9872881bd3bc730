"""Zero-copy gradient buckets between two namespaced hosts: inside each host the buckets are
reduced where they lie, between the hosts each local rank's slice crosses the link while the
next piece is summed (the hierarchical path).  The bits must be those of the copying path,
with buckets of one piece and of many."""

import os

import pytest
import torch

from .conftest import REPO, Job

SCRIPT = os.path.join(REPO, "tests", "torch_integration", "workers", "zero_copy_train.py")
HOSTS = ["-np", "4", "-H", "tbh0:2,tbh1:2", "-x", "ZC_OUT", "-x", "ZC_RUNS"]
RUNS = ("1:none", "0:none", "1:none:small", "0:none:small")


@pytest.mark.timeout(200)
def test_zero_copy_across_hosts_gives_the_copying_paths_bits(testbed, tmp_path):
    env = {"ZC_OUT": str(tmp_path), "ZC_RUNS": ",".join(RUNS)}
    job = Job(testbed, "tbh0", HOSTS, SCRIPT, env=env)
    assert job.finish(180) == 0, job.text()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for r, runs in enumerate(ranks):
        for on, off in [("1:none", "0:none"), ("1:none:small", "0:none:small")]:
            for key in ("params", "momentum"):
                for i, (x, y) in enumerate(zip(runs[on][key], runs[off][key])):
                    assert torch.equal(x, y), f"rank {r}, {on}: {key}[{i}] differs"
                    assert torch.equal(x, ranks[0][on][key][i]), f"rank {r} vs 0: {key}[{i}]"
            assert all(runs[on]["shared"]) and not any(runs[off]["shared"])
            counts = list(runs[on]["zero_copy"].values())  # [not zero-copy, zero-copy]
            assert len(counts) == 1 and counts[0][0] == 0 and counts[0][1] >= 6, counts
