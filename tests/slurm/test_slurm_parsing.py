"""Slurm's hostlist and tasks-per-node forms, the allocation's hosts, and a plain srun
rank's identity: parsed from injected variables (no Slurm needed)."""

import pytest

from hvdlite.common.slurm import environment as slurm
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.slurm import allocation as slurm_hosts

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "spec, names",
    [
        ("vm", ["vm"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("x[3],y,z[0-1]s", ["x3", "y", "z0s", "z1s"]),
        ("node-1,node-2", ["node-1", "node-2"]),
    ],
)
def test_hostlists_expand(spec, names):
    assert slurm.expand_hostlist(spec) == names


@pytest.mark.parametrize(
    "spec, why",
    [
        ("node[1-2", "never closed"),
        ("node1-2]", "without"),
        ("a,,b", "empty host"),
        ("node[2-1]", "runs backwards"),
        ("node[a-b]", "not a number"),
        ("node[]", "not a number"),
        ("n[1-[2]]", "nested"),
        ("", "empty host"),
    ],
)
def test_bad_hostlists_name_the_variable(spec, why):
    with pytest.raises(HvdliteConfigError, match=why) as err:
        slurm.expand_hostlist(spec, "SLURM_JOB_NODELIST")
    assert "SLURM_JOB_NODELIST" in str(err.value)


@pytest.mark.parametrize(
    "spec, counts",
    [
        ("2", [2]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("1,4(x2)", [1, 4, 4]),
        ("8(x1)", [8]),
    ],
)
def test_tasks_per_node_expand(spec, counts):
    assert slurm.expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["2(x0)", "x3", "2(3)", "", "2,", "-1"])
def test_bad_tasks_per_node_name_the_variable(spec):
    with pytest.raises(HvdliteConfigError, match="SLURM_TASKS_PER_NODE"):
        slurm.expand_tasks_per_node(spec)


def test_allocation_hosts_from_the_job_variables():
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[01-03],gpu7",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
    }
    assert slurm_hosts.allocation_hosts(env) == [
        HostSlots("node01", 2),
        HostSlots("node02", 2),
        HostSlots("node03", 2),
        HostSlots("gpu7", 1),
    ]
    assert "SLURM_JOB_NODELIST=node[01-03],gpu7" in slurm_hosts.describe(env)


def test_the_older_nodelist_name_counts_too():
    env = {"SLURM_JOBID": "7", "SLURM_NODELIST": "a[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert slurm_hosts.allocation_hosts(env) == [HostSlots("a1", 1), HostSlots("a2", 1)]


def test_no_allocation_outside_slurm():
    assert slurm_hosts.allocation_hosts({}) is None
    assert slurm_hosts.allocation_hosts({"SLURM_JOB_NODELIST": "a1"}) is None  # no job id
    assert not slurm_hosts.srun_reaches(["a1"], {})


def test_mismatched_counts_name_both_variables():
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(
        HvdliteConfigError, match="SLURM_JOB_NODELIST.*3 nodes.*SLURM_TASKS_PER_NODE.*for 2"
    ):
        slurm_hosts.allocation_hosts(env)


def test_missing_tasks_per_node_is_an_error():
    with pytest.raises(HvdliteConfigError, match="SLURM_TASKS_PER_NODE is not"):
        slurm_hosts.allocation_hosts({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a1"})


def _step(procid, localid, nodeid, **extra):
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_ID": "3",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "3,2",
        "HVDLITE_SECRET_KEY": "ab" * 16,
    }
    env.update(extra)
    return env


def test_a_plain_srun_rank_takes_its_place_from_the_step():
    env = slurm.srun_step_env(_step(4, 1, 1))
    port = env.pop("HVDLITE_RENDEZVOUS_PORT")
    assert env == {
        "HVDLITE_RANK": "4",
        "HVDLITE_SIZE": "5",
        "HVDLITE_LOCAL_RANK": "1",
        "HVDLITE_LOCAL_SIZE": "2",
        "HVDLITE_CROSS_RANK": "1",
        "HVDLITE_CROSS_SIZE": "2",
        "HVDLITE_HOSTNAME": "n2",
        "HVDLITE_RENDEZVOUS_ADDR": "n1",
        "HVDLITE_JOB_ID": "slurm-1234.3",
    }
    # every rank of the step derives the same port; another step of the job another one
    assert port == slurm.srun_step_env(_step(0, 0, 0))["HVDLITE_RENDEZVOUS_PORT"]
    assert port != slurm.srun_step_env(_step(0, 0, 0, SLURM_STEP_ID="4"))["HVDLITE_RENDEZVOUS_PORT"]
    # local rank 2 exists on the first node only
    assert slurm.srun_step_env(_step(2, 2, 0))["HVDLITE_CROSS_SIZE"] == "1"


def test_an_exported_port_wins():
    env = slurm.srun_step_env(_step(0, 0, 0, HVDLITE_RENDEZVOUS_PORT="31000"))
    assert "HVDLITE_RENDEZVOUS_PORT" not in env


def test_without_a_key_a_plain_srun_rank_is_told_how_to_make_one():
    env = _step(1, 1, 0)
    del env["HVDLITE_SECRET_KEY"]
    with pytest.raises(HvdliteConfigError, match="HVDLITE_SECRET_KEY is not set.*slurm.key"):
        slurm.srun_step_env(env)


def test_a_cyclic_distribution_is_refused():
    with pytest.raises(HvdliteConfigError, match="--distribution=block"):
        slurm.srun_step_env(_step(1, 0, 1))


@pytest.mark.parametrize(
    "env",
    [
        {},  # not in Slurm
        {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},  # the batch script
        _step(0, 0, 0, SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1,0"),  # one task
        _step(0, 0, 0, HVDLITE_RENDEZVOUS_ADDR="10.0.0.1"),  # started by hvdlite-run
    ],
)
def test_other_processes_take_nothing_from_slurm(env):
    assert slurm.srun_step_env(env) == {}


def test_an_mpi_step_takes_nothing_from_slurm():
    assert slurm.srun_step_env(_step(0, 0, 0), mpi_step=True) == {}


def test_a_bad_step_variable_is_named():
    with pytest.raises(HvdliteConfigError, match="SLURM_LOCALID='x'"):
        slurm.srun_step_env(_step(0, "x", 0))


CMD = ["python", __file__]


def _launch_env(monkeypatch):
    for name in (
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_TASKS_PER_NODE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "3")


def test_hvdlite_run_defaults_to_the_allocation(monkeypatch):
    from hvdlite.runner.cli import launch

    _launch_env(monkeypatch)
    s = launch.spec_from_args(launch.parse_args([*CMD]))
    assert s.np == 3 and s.hosts == [HostSlots("localhost", 3)]
    # a static job's spec holds the slots its ranks use, placed once
    s = launch.spec_from_args(launch.parse_args(["-np", "2", *CMD]))
    assert s.np == 2 and s.hosts == [HostSlots("localhost", 2)]
    # -H wins over the allocation: its hosts, and -np is then needed as always
    s = launch.spec_from_args(launch.parse_args(["-np", "5", "-H", "localhost:5", *CMD]))
    assert s.hosts == [HostSlots("localhost", 5)]
    with pytest.raises(HvdliteConfigError, match="-np is required"):
        launch.spec_from_args(launch.parse_args(["-H", "localhost:5", *CMD]))


def test_more_ranks_than_the_allocation_names_it(monkeypatch):
    from hvdlite.runner.cli import launch

    _launch_env(monkeypatch)
    with pytest.raises(
        HvdliteConfigError,
        match="-np 4 .* 3 tasks of the Slurm allocation "
        r"\(SLURM_JOB_NODELIST=localhost",
    ):
        launch.spec_from_args(launch.parse_args(["-np", "4", *CMD]))


def test_the_srun_command_of_a_task():
    from hvdlite.runner.slurm.srun_tasks import srun_command

    cmd = srun_command("node07", python="/py", srun="/bin/srun")
    assert cmd[0] == "/bin/srun" and cmd[-3:] == ["/py", "-m", "hvdlite.runner.tasks.task_service"]
    for flag in (
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=node07",
        "--overlap",
        "--mpi=none",
        "--kill-on-bad-exit=1",
        "--cpu-bind=none",
    ):
        assert flag in cmd


def test_srun_is_used_only_for_nodes_of_the_allocation(monkeypatch, tmp_path):
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "1(x3)"}
    assert slurm_hosts.srun_reaches(["n2", "n3"], env)
    assert not slurm_hosts.srun_reaches(["n2", "elsewhere"], env)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert not slurm_hosts.srun_reaches(["n2"], env)  # no srun on PATH
