"""The one-node Slurm cluster the Slurm tests run on (started once per session, ended by
pid at its end); skipped with the reason when Slurm or munge is not installed."""

import os

import pytest

from tests.slurm.cluster import Cluster, missing


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    absent = missing()
    if absent:
        pytest.skip(
            f"Slurm is not installed (missing {', '.join(absent)}): run "
            f"tests/setup_system.sh as root"
        )
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster runs its daemons as root")
    cluster = Cluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.start()
    yield cluster
    cluster.stop()
