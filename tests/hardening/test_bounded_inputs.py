"""Issue 35, item 6: bad inputs are refused before anything is placed or spawned, with a
message naming the flag, host or file; discovery output is read bounded and logged
printable."""

import os
import resource
import sys
import textwrap
import time

import psutil
import pytest

from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.runner.cli import launch
from hvdlite.runner.hosts import parse_hostfile, parse_hosts
from hvdlite.runner.hosts.script import MAX_OUTPUT_BYTES, ScriptHosts, parse_discovery_output
from hvdlite.runner.hosts.slots import HostSlots
from hvdlite.runner.hosts.source import HostDiscoveryError
from hvdlite.runner.tasks.ssh import SSHOptions, agent_task

from tests import launching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(60)


def _launch(args, env=None, timeout=30):
    """Run the launcher; returns (result, seconds)."""
    started = time.monotonic()
    r = launching.run(args, env=env, timeout=timeout, pythonpath=[ROOT], cwd=ROOT)
    return r, time.monotonic() - started


def _refused(r, seconds, marker):
    """One error line, exit code 2, fast, and no worker ran (the marker is not there)."""
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
    assert seconds < 10, f"took {seconds:.1f}s to refuse"
    assert not marker.exists(), "a worker started despite the refusal"
    return lines[0]


def _touch(marker):
    return [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]


# ---- 1: the worker ceiling ------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["-np", "99999999999999999999"], "-np 99999999999999999999: more than the 1024"),
        (["-np", "10000"], "-np 10000: more than the 1024 worker processes"),
        (["-np", "2000", "-H", "localhost:4000"], "-np 2000: more than the 1024"),
        (["--min-np", "2", "--max-np", "5000", "-H", "localhost:2"], "--max-np 5000: more than"),
        (["--min-np", "2000", "-H", "localhost:4000"], "-np 2000: more than"),
        (["-np", "8", "--max-workers", "4"], "-np 8: more than the 4 worker processes"),
        (["-np", "2", "--max-workers", "0"], "--max-workers 0: the value must be 1..1048576"),
    ],
)
def test_worker_ceiling_refuses_before_placing(flags, expected, tmp_path):
    marker = tmp_path / "started"
    r, seconds = _launch([*flags, *_touch(marker)])
    line = _refused(r, seconds, marker)
    assert expected in line, line


def test_worker_ceiling_from_the_environment_names_the_variable(tmp_path):
    marker = tmp_path / "started"
    r, seconds = _launch(["-np", "3", *_touch(marker)], env={"HVDLITE_MAX_WORKERS": "2"})
    line = _refused(r, seconds, marker)
    assert "-np 3: more than the 2 worker processes" in line and "HVDLITE_MAX_WORKERS" in line


def test_worker_ceiling_names_the_config_file_key(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("elastic:\n  max-np: 5000\n")
    marker = tmp_path / "started"
    r, seconds = _launch(
        ["--config-file", str(conf), "--min-np", "1", "-H", "localhost:2", *_touch(marker)]
    )
    line = _refused(r, seconds, marker)
    assert f"--config-file {conf}: elastic.max-np 5000: more than the 1024" in line, line


def test_elastic_job_without_max_np_is_capped_at_the_ceiling(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    args = launch.parse_args(
        ["-np", "1", "--host-discovery-script", str(script), "--max-workers", "64", "true"]
    )
    settings = launch.spec_from_args(args)
    assert settings.elastic.max_np == 64 and settings.tunables.max_workers == 64


def test_a_spec_built_without_the_cli_is_held_to_the_ceiling_before_anything_starts():
    """A platform's spec (a plain srun step's, one built by hand) skips the CLI's checks:
    ``run_job`` holds it to --max-workers itself, naming the sizes as the caller does."""
    from hvdlite.runner.agent.job import run_job
    from hvdlite.runner.agent.settings import SizeNames
    from hvdlite.runner.agent.spec import JobSpec

    def spec(np, **fields):
        started = []
        return JobSpec(
            np=np,
            hosts=[HostSlots("localhost", np)],
            command=[],
            starter=lambda job: started.append(job),
            **fields,
        ), started

    big, started = spec(5000)
    with pytest.raises(
        HvdliteConfigError,
        match=r"^-np 5000: more than the 1024 worker "
        r"processes one job may run",
    ):
        run_job(big)
    named, _ = spec(3, size_names=SizeNames(np="num_proc", joiner="="))
    named.tunables = named.tunables.replace(max_workers=2)
    with pytest.raises(
        HvdliteConfigError,
        match=r"^num_proc=3: more than the 2 worker "
        r"processes .*; lower num_proc, or raise",
    ):
        run_job(named)
    assert started == [], "a starter was made despite the refusal"


def test_ray_executor_names_its_own_arguments_in_size_errors(monkeypatch):
    pytest.importorskip("ray")
    from hvdlite.ray.ray_executor import RayExecutor

    monkeypatch.setenv("HVDLITE_MAX_WORKERS", "4")
    with pytest.raises(HvdliteConfigError, match=r"^num_workers=8: more than the 4 worker"):
        RayExecutor(num_workers=8)
    with pytest.raises(HvdliteConfigError, match=r"^max_workers=6: more than the 4 worker"):
        RayExecutor(min_workers=1, max_workers=6)
    with pytest.raises(HvdliteConfigError, match=r"^min_workers=3 is more than max_workers=2$"):
        RayExecutor(min_workers=3, max_workers=2)


def test_discovered_slots_over_the_ceiling_are_a_failed_discovery():
    with pytest.raises(
        HostDiscoveryError,
        match=r"host 'localhost' has 100000 slots, more "
        r"than the 1024",
    ):
        parse_discovery_output("localhost:100000\n", max_slots=1024)
    with pytest.raises(HostDiscoveryError, match="has 1025 slots"):
        parse_discovery_output("a:1000\na:25\n", max_slots=1024)
    assert parse_discovery_output("a:1024\n", max_slots=1024) == [HostSlots("a", 1024)]


# ---- 2: discovery output, bounded and printable ---------------------------------------


def _script(tmp_path, body):
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


def test_discovery_output_over_the_limit_is_a_failure_and_is_not_read_whole(tmp_path):
    script = _script(tmp_path, "exec cat /dev/zero\n")  # never ends, never stops
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.raises(
        HostDiscoveryError,
        match=rf"printed more than {MAX_OUTPUT_BYTES} "
        r"bytes .*it was ended",
    ) as info:
        ScriptHosts(script, timeout_s=10).find()
    assert time.monotonic() - started < 5
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 64 * 1024, f"RSS grew {grown_kib} KiB"
    assert len(info.value.output) < 3000
    assert not [p for p in psutil.Process().children(recursive=True) if "cat" in p.name()], (
        "the script's cat was left running"
    )


def test_binary_discovery_output_is_logged_printable(tmp_path):
    script = _script(tmp_path, r"printf 'host\033[31m\007:1\n'; printf '\033]0;x\007' >&2")
    with pytest.raises(HostDiscoveryError) as info:
        ScriptHosts(script).find()
    text = str(info.value) + info.value.output
    assert "\x1b" not in text and "\x07" not in text
    assert "\\x1b[31m\\x07" in info.value.output


def test_failing_discovery_keeps_the_previous_hosts_and_logs_printable(tmp_path, caplog):
    from hvdlite.runner.agent.poller import DiscoveryPoller

    flag = tmp_path / "bad"
    script = _script(
        tmp_path,
        f"""\
        if [ -e {flag} ]; then printf 'x\\033[2J'; head -c 2000000 /dev/zero; fi
        echo localhost:2
        """,
    )
    poller = DiscoveryPoller(ScriptHosts(script), on_change=lambda: None)
    poller.poll_once()
    assert poller.hosts == [HostSlots("localhost", 2)]
    flag.write_text("")
    poller.poll_once()
    assert poller.hosts == [HostSlots("localhost", 2)] and poller.failures == 1
    assert "printed more than" in caplog.text and "\x1b" not in caplog.text


# ---- 3: parsing: YAML booleans, undecodable files, float ranges ------------------------


@pytest.mark.parametrize(
    "yaml_text, expected",
    [
        (
            'stall_check:\n  enabled: "false"\n',
            "stall_check.enabled: expected true or false (a YAML boolean, unquoted), got 'false'",
        ),
        ('timeline:\n  enabled: "no"\n  filename: /tmp/t.json\n', "timeline.enabled: expected"),
        ('params:\n  hierarchical_allreduce: "true"\n', "params.hierarchical_allreduce: expected"),
        ('no-stall-check: "yes"\n', "no-stall-check: expected true or false"),
    ],
)
def test_config_file_refuses_text_for_a_boolean(yaml_text, expected, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    marker = tmp_path / "started"
    r, seconds = _launch(["--config-file", str(f), "-np", "1", *_touch(marker)])
    line = _refused(r, seconds, marker)
    assert f"--config-file {f}: {expected}" in line, line


def test_config_file_takes_real_yaml_booleans_yes_and_no_included(tmp_path):
    from hvdlite.runner.cli import config_file
    from hvdlite.runner.cli import flags

    for text, off in (("false", True), ("no", True), ("true", False), ("yes", False)):
        f = tmp_path / "c.yaml"
        f.write_text(f"stall_check:\n  enabled: {text}\n")
        got = config_file.config_file_defaults(flags.build_parser(), str(f))
        assert got == {"no_stall_check": off}, text


def test_binary_config_file_and_hostfile_name_the_file_and_line(tmp_path):
    marker = tmp_path / "started"
    conf = tmp_path / "c.yaml"
    conf.write_bytes(b"params:\n  cache_capacity: 4\n\x89PNG\xff\x00\n")
    r, seconds = _launch(["--config-file", str(conf), "-np", "1", *_touch(marker)])
    line = _refused(r, seconds, marker)
    assert f"--config-file {conf}: line 3 is not UTF-8 text" in line
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(b"localhost slots=2\n\xff\xfe\n")
    r, seconds = _launch(["--hostfile", str(hostfile), "-np", "1", *_touch(marker)])
    line = _refused(r, seconds, marker)
    assert f"--hostfile {hostfile}: line 2 is not UTF-8 text" in line
    with pytest.raises(HvdliteConfigError, match="line 2 is not UTF-8"):
        parse_hostfile(str(hostfile))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--op-timeout-seconds", "1e308"],
            "--op-timeout-seconds 1e+308: the value must be 0.001..10000000 seconds",
        ),
        (["--op-timeout-seconds", "0"], "--op-timeout-seconds 0: the value must be 0.001.."),
        (["--op-timeout-seconds", "inf"], "--op-timeout-seconds inf: must be a finite number"),
        (
            ["--stall-check-warning-time-seconds", "1e9"],
            "--stall-check-warning-time-seconds 1e+09: the value must be 0..10000000 seconds",
        ),
        (["--start-timeout", "1e308"], "--start-timeout 1e+308: the value must be 0.001.."),
        # scaled to bytes, 1e308 MiB overflowed int() (a traceback)
        (
            ["--fusion-threshold-mb", "1e308"],
            "--fusion-threshold-mb 1e+308: the value must be 0..2147483647 bytes",
        ),
        (["--timeline-max-mb", "1e308"], "--timeline-max-mb 1e+308: the value must be 0.."),
        (["--timeline-max-mb", "1e10"], "--timeline-max-mb 1e+10: the value must be 0.."),
    ],
)
def test_float_flags_state_their_range(flags, expected, tmp_path):
    marker = tmp_path / "started"
    r, seconds = _launch([*flags, "-np", "1", *_touch(marker)])
    line = _refused(r, seconds, marker)
    assert expected in line, line


# ---- 5: a host that could pass as an option --------------------------------------------


@pytest.mark.parametrize(
    "spec", ["-oProxyCommand=touch${IFS}/tmp/pwned:1", "-oProxyCommand=x@host:1", "user@-x:1"]
)
def test_host_names_that_look_like_options_are_refused(spec, tmp_path):
    with pytest.raises(HvdliteConfigError, match="cannot start with '-'"):
        parse_hosts(f"localhost:1,{spec}")
    marker = tmp_path / "started"
    r, seconds = _launch(["-np", "2", f"--hosts=localhost:1,{spec}", *_touch(marker)])
    assert "cannot start with '-'" in _refused(r, seconds, marker)


def test_discovered_host_that_looks_like_an_option_is_a_failed_discovery():
    with pytest.raises(HostDiscoveryError, match="line 1"):
        parse_discovery_output("-oProxyCommand=x:1\n")


def test_launcher_agent_never_gets_an_option_for_a_host(tmp_path):
    """The agent's contract is 'CMD HOST COMMAND' (kubexec.sh reads $1 $2), so the
    host is checked instead of being preceded by '--'; the fake agent records its argv."""
    calls = tmp_path / "argv"
    agent = tmp_path / "agent.sh"
    agent.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\nexec sh -c "$2"\n')
    agent.chmod(0o755)
    opts = SSHOptions(launcher_agent=str(agent))
    for host in (
        HostSlots("-oProxyCommand=touch /tmp/x", 1),
        HostSlots("node", 1, user="-oProxyCommand=x"),
    ):
        with pytest.raises(HvdliteConfigError, match="--launcher-agent: host"):
            agent_task(host, b"{}", opts)
    assert not calls.exists(), "the agent was run"


def test_hosts_from_lsf_variables_that_look_like_options_are_refused():
    from hvdlite.runner.hosts.cluster_env import parse_lsf_hosts, parse_lsf_mcpu_hosts

    with pytest.raises(HvdliteConfigError, match="LSB_HOSTS: '-oProxyCommand=x'"):
        parse_lsf_hosts("a -oProxyCommand=x")
    with pytest.raises(HvdliteConfigError, match="LSB_MCPU_HOSTS: .*cannot start with '-'"):
        parse_lsf_mcpu_hosts("a 1 -x 2")


@pytest.mark.parametrize(
    "body, expected",
    [
        ("echo localhost:100000\n", "host 'localhost' has 100000 slots, more than the 1024"),
        ("head -c 400000000 /dev/zero\n", "printed more than 1048576 bytes"),
    ],
)
def test_launcher_refuses_a_first_discovery_over_the_bounds(body, expected, tmp_path):
    """The launcher's first discovery: nothing is placed, nothing spawned, in about a
    second (a 400 MB answer is not read whole)."""
    script = _script(tmp_path, body)
    marker = tmp_path / "started"
    r, seconds = _launch(
        ["-np", "1", "--host-discovery-script", script, "--elastic-timeout", "2", *_touch(marker)]
    )
    assert r.returncode != 0 and not marker.exists(), r.stdout + r.stderr
    assert seconds < 10 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert f"--host-discovery-script {script}" in r.stderr
