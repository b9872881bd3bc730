"""Host parsing and rank assignment (pure logic)."""

import pytest

from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.runner.hosts import HostSlots, assign_slots, is_local, parse_hostfile, parse_hosts

pytestmark = pytest.mark.timeout(30)


def test_parse_hosts_with_users_and_defaults():
    hosts = parse_hosts("a:2, bob@b ,c:3")
    assert hosts == [HostSlots("a", 2), HostSlots("b", 1, "bob"), HostSlots("c", 3)]
    assert hosts[1].ssh_target == "bob@b"


def test_parse_hosts_merges_duplicates():
    assert parse_hosts("a:1,b:1,a:2") == [HostSlots("a", 3), HostSlots("b", 1)]


@pytest.mark.parametrize(
    "spec,fragment",
    [
        (":2", "no host name"),
        ("a:x", "not a number"),
        ("a:0", "at least 1"),
        (",", "no hosts"),
        ("@a:1", "user@"),
    ],
)
def test_parse_hosts_errors_name_the_entry(spec, fragment):
    with pytest.raises(HvdliteConfigError, match=fragment):
        parse_hosts(spec)


def test_hostfile_comments_blank_lines(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\n\nnode1 slots=2   # two GPUs\nalice@node2 slots=1\nnode3\n")
    assert parse_hostfile(str(f)) == [
        HostSlots("node1", 2),
        HostSlots("node2", 1, "alice"),
        HostSlots("node3", 1),
    ]


@pytest.mark.parametrize(
    "line",
    [
        "node1 slots=x",
        "node1 slot=2",
        "node1 slots=2 extra",
        "node1:x",
        "node1:0",
        "node1:2 slots=2",
        "node1 slots=0",
        "node1 slots",
    ],
)
def test_hostfile_bad_line_names_file_and_line(tmp_path, line):
    f = tmp_path / "hosts"
    f.write_text(f"ok slots=1\n{line}\n")
    with pytest.raises(HvdliteConfigError) as err:
        parse_hostfile(str(f))
    assert "line 2" in str(err.value) and str(f) in str(err.value)


def test_hostfile_missing_or_empty(tmp_path):
    with pytest.raises(HvdliteConfigError, match="cannot read"):
        parse_hostfile(str(tmp_path / "nope"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(HvdliteConfigError, match="no hosts"):
        parse_hostfile(str(tmp_path / "empty"))


def test_assign_uneven_slots():
    slots = assign_slots([HostSlots("a", 3), HostSlots("b", 1), HostSlots("c", 2)], 6)
    got = [
        (s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots
    ]
    assert got == [
        ("a", 0, 0, 3, 0, 3),
        ("a", 1, 1, 3, 0, 2),
        ("a", 2, 2, 3, 0, 1),
        ("b", 3, 0, 1, 1, 3),
        ("c", 4, 0, 2, 2, 3),
        ("c", 5, 1, 2, 1, 2),
    ]
    assert all(s.size == 6 for s in slots)


def test_assign_fewer_ranks_than_slots_skips_unused_hosts():
    slots = assign_slots([HostSlots("a", 2), HostSlots("b", 2)], 2)
    assert [s.hostname for s in slots] == ["a", "a"]
    assert all(s.cross_size == 1 for s in slots)


def test_assign_errors():
    with pytest.raises(HvdliteConfigError, match="at least 1"):
        assign_slots([HostSlots("a", 1)], 0)
    with pytest.raises(HvdliteConfigError, match="more processes than the 3 slots"):
        assign_slots([HostSlots("a", 1), HostSlots("b", 2)], 4)


def test_is_local():
    import socket

    assert is_local("localhost") and is_local("127.0.0.1") and is_local(socket.gethostname())
    assert not is_local("127.0.0.2")
    assert not is_local("no-such-host.invalid")


def test_hostfile_mpich_form_and_mixed(tmp_path):
    """MPICH / Intel MPI write ``host:N``; Open MPI ``host slots=N``; both may be mixed."""
    f = tmp_path / "hosts"
    f.write_text("worker-0:4\nworker-1 slots=2\nbob@worker-2:1\nworker-0:1\n")
    assert parse_hostfile(str(f)) == [
        HostSlots("worker-0", 5),
        HostSlots("worker-1", 2),
        HostSlots("worker-2", 1, "bob"),
    ]


def test_cluster_environment_hosts(tmp_path):
    from hvdlite.runner.hosts.cluster_env import hosts_from_environment

    assert hosts_from_environment({}) is None
    f = tmp_path / "hostfile"
    f.write_text("pod-worker-0 slots=2\npod-worker-1 slots=2\n")
    hosts, where = hosts_from_environment(
        {"OMPI_MCA_orte_default_hostfile": str(f), "LSB_MCPU_HOSTS": "x 1"}
    )
    assert hosts == [HostSlots("pod-worker-0", 2), HostSlots("pod-worker-1", 2)]
    assert where == f"OMPI_MCA_orte_default_hostfile={f}"
    with pytest.raises(HvdliteConfigError, match="OMPI_MCA_orte_default_hostfile.*cannot read"):
        hosts_from_environment({"OMPI_MCA_orte_default_hostfile": str(tmp_path / "none")})
    hosts, where = hosts_from_environment(
        {"LSB_MCPU_HOSTS": "hostA 4 hostB 2 hostA 1", "LSB_HOSTS": "ignored"}
    )
    assert hosts == [HostSlots("hostA", 5), HostSlots("hostB", 2)] and "LSB_MCPU_HOSTS" in where
    hosts, where = hosts_from_environment({"LSB_HOSTS": "hostA hostA hostB"})
    assert hosts == [HostSlots("hostA", 2), HostSlots("hostB", 1)] and "LSB_HOSTS" in where


@pytest.mark.parametrize("value", ["hostA", "hostA 4 hostB", "hostA x", "hostA 0"])
def test_lsf_mcpu_hosts_malformed_names_the_variable(value):
    from hvdlite.runner.hosts.cluster_env import hosts_from_environment

    with pytest.raises(HvdliteConfigError, match="LSB_MCPU_HOSTS"):
        hosts_from_environment({"LSB_MCPU_HOSTS": value})
