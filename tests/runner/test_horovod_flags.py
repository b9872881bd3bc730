"""horovodrun compatibility of hvdlite-run: every horovodrun flag, Horovod's YAML config file,
HOROVOD_* variables honoured by the launcher and forwarded to every host."""

import re
import subprocess
import sys

import pytest

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError
from hvdlite.runner.agent import rank_env
from hvdlite.runner.cli import flags
from hvdlite.runner.cli import launch
from hvdlite.runner.hosts import HostSlots
from hvdlite.runner.starters.mpiexec import HYDRA, OPENMPI, build_command

from conftest import REPO, run_launcher, worker

pytestmark = pytest.mark.timeout(60)
KV = worker("kv_worker.py")
OK, REFUSED, EXITS = "ok", "refused", "exits 0"

#: horovodrun's flags as its parser (horovod/runner/launch.py) defines them, with an example
#: value each, and what hvdlite-run does with them.  ``{file}``, ``{hostfile}`` and
#: ``{script}`` are filled with real files.
HOROVODRUN_FLAGS = [
    (["-v"], EXITS),
    (["--version"], EXITS),
    (["--num-proc", "1"], OK),
    (["-cb"], EXITS),
    (["--check-build"], EXITS),
    (["--disable-cache"], OK),
    (["--start-timeout", "20"], OK),
    (["--network-interface", "lo"], OK),
    (["--network-interfaces", "lo"], OK),
    (["--nics", "lo"], OK),
    (["--output-filename", "{dir}"], OK),
    (["--verbose"], OK),
    (["--config-file", "{file}"], OK),
    (["-p", "2222"], OK),
    (["--ssh-port", "2222"], OK),
    (["-i", "{file}"], OK),
    (["--ssh-identity-file", "{file}"], OK),
    (["--fusion-threshold-mb", "32"], OK),
    (["--cycle-time-ms", "2"], OK),
    (["--cache-capacity", "512"], OK),
    (["--hierarchical-allreduce"], OK),
    (["--no-hierarchical-allreduce"], OK),
    (["--hierarchical-allgather"], OK),
    (["--no-hierarchical-allgather"], OK),
    (["--shared-memory"], OK),
    (["--no-shared-memory"], OK),
    (["--gc-freeze"], OK),
    (["--no-gc-freeze"], OK),
    (["--autotune"], OK),
    (["--no-autotune"], OK),
    (["--autotune-log-file", "a.csv"], OK),
    (["--autotune-warmup-samples", "3"], OK),
    (["--autotune-steps-per-sample", "10"], OK),
    (["--autotune-bayes-opt-max-samples", "20"], OK),
    (["--autotune-gaussian-process-noise", "0.8"], OK),
    (["--min-np", "1"], OK),
    (["--max-np", "2"], OK),
    (["--slots-per-host", "1", "--min-np", "1"], OK),
    (["--elastic-timeout", "60", "--min-np", "1"], OK),
    (["--reset-limit", "2", "--min-np", "1"], OK),
    (["--blacklist-cooldown-range", "1", "5", "--min-np", "1"], OK),
    (["--timeline-filename", "t.json"], OK),
    (["--timeline-mark-cycles"], OK),
    (["--no-timeline-mark-cycles"], OK),
    (["--no-stall-check"], OK),
    (["--stall-check"], OK),
    (["--stall-check-warning-time-seconds", "30"], OK),
    (["--stall-check-shutdown-time-seconds", "60"], OK),
    (["--mpi-threads-disable"], REFUSED),
    (["--no-mpi-threads-disable"], OK),
    (["--mpi-args=-l", "--mpi"], OK),
    (["--tcp"], OK),
    (["--binding-args", "--bind-to core", "--mpi"], OK),
    (["--binding-args", "--bind-to core"], REFUSED),  # Gloo mode binds nothing
    (["--num-nccl-streams", "2"], REFUSED),
    (["--torus-allreduce"], REFUSED),
    (["--no-torus-allreduce"], OK),
    (["--thread-affinity", "0"], REFUSED),
    (["--gloo-timeout-seconds", "30"], OK),
    (["--log-level", "INFO"], OK),
    (["--log-level", "TRACE"], OK),
    (["--log-with-timestamp"], REFUSED),
    (["--no-log-hide-timestamp"], REFUSED),
    (["--log-without-timestamp"], OK),
    (["--log-hide-timestamp"], OK),
    (["-prefix-timestamp"], OK),
    (["--prefix-output-with-timestamp"], OK),
    (["-H", "localhost:1"], OK),
    (["--hosts", "localhost:1"], OK),
    (["-hostfile", "{hostfile}"], OK),
    (["--hostfile", "{hostfile}"], OK),
    (["--host-discovery-script", "{script}"], OK),
    (["--gloo"], OK),
    (["--mpi"], OK),
    (["--jsrun"], REFUSED),
]


@pytest.fixture
def files(tmp_path):
    conf = tmp_path / "c.yaml"
    conf.write_text("params:\n  cycle_time_ms: 2\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    return {
        "file": str(conf),
        "hostfile": str(hostfile),
        "script": str(script),
        "dir": str(tmp_path / "out"),
    }


def settings(argv):
    return launch.spec_from_args(launch.parse_args(argv))


@pytest.mark.parametrize(
    "tokens, outcome", HOROVODRUN_FLAGS, ids=[" ".join(t) for t, _ in HOROVODRUN_FLAGS]
)
def test_every_horovodrun_flag_is_implemented_or_refused_with_a_reason(
    tokens, outcome, files, capsys
):
    tokens = [t.format(**files) for t in tokens]
    argv = tokens + ["-np", "1", KV] if "--num-proc" not in tokens else tokens + [KV]
    if outcome == EXITS:
        assert launch.main(argv) == 0
        assert capsys.readouterr().out.strip()
        return
    try:
        result = settings(argv)
    except SystemExit:  # argparse's own error: never for a horovodrun flag
        pytest.fail(f"argparse refused {tokens}: {capsys.readouterr().err}")
    except HvdliteConfigError as exc:
        assert outcome == REFUSED, f"{tokens} refused: {exc}"
        flag, _, reason = str(exc).partition(": ")
        assert tokens[0] in flag.split("/"), str(exc)  # names the flag...
        assert len(reason) > 30, str(exc)  # ...and says why
        assert launch.main(argv) == 2
        assert capsys.readouterr().err.startswith(f"hvdlite-run: error: {flag}: ")
        return
    assert outcome == OK, f"{tokens} was accepted: {result}"


def test_the_flag_list_covers_the_parser_and_the_refusal_table():
    parser_flags = set(flags.build_parser()._option_string_actions)
    listed = {t[0].split("=")[0] for t, _ in HOROVODRUN_FLAGS}
    assert listed <= parser_flags
    for flag, _ in flags.REFUSED_FLAGS.values():
        assert set(flag.split("/")) <= listed | {"-np"}
    for flag in flags.NO_OP_FLAGS:
        assert flag in listed


def test_horovodrun_flags_map_to_hvdlite_settings(monkeypatch):
    s = settings(
        [
            "--gloo-timeout-seconds",
            "30",
            "--stall-check",
            "--log-level",
            "trace",
            "--nics",
            "lo, eth0",
            "-prefix-timestamp",
            "-np",
            "1",
            KV,
        ]
    )
    assert s.tunable_env()[cfg.OP_TIMEOUT] == "30.0"
    assert s.tunable_env().get(cfg.STALL_CHECK_DISABLE, "0") == "0"  # on, the default
    assert s.network_interfaces == ["lo", "eth0"] and s.timestamp_output
    c = cfg.Config.from_env(s.tunable_env())
    assert (c.op_timeout_s, c.stall_check, c.log_level) == (30.0, True, "DEBUG")
    s = settings(["--binding-args", "--bind-to core --map-by socket", "--mpi", "-np", "1", KV])
    assert s.binding_args == ["--bind-to", "core", "--map-by", "socket"]


def test_binding_args_reach_mpiexec():
    hosts = [HostSlots("a", 2)]
    cmd = build_command(
        OPENMPI, "mpirun", 2, hosts, {}, [], [], ["t"], binding_args=["--bind-to", "core"]
    )
    assert "--bind-to" in cmd and cmd[cmd.index("--bind-to") + 1] == "core"
    assert "none" not in cmd
    cmd = build_command(OPENMPI, "mpirun", 2, hosts, {}, [], [], ["t"])
    assert cmd[cmd.index("--bind-to") + 1] == "none"  # the default stays
    cmd = build_command(
        HYDRA, "mpiexec", 2, hosts, {}, [], [], ["t"], binding_args=["-bind-to", "core"]
    )
    assert cmd[cmd.index("-bind-to") + 1] == "core"


# ---------------------------------------------------------------- HOROVOD_* in the launcher


def test_launcher_reads_horovod_timeouts_and_flags_win(monkeypatch):
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "45")
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "77")
    assert settings(["-np", "1", KV]).start_timeout_s == 45.0
    assert settings(["--start-timeout", "9", "-np", "1", KV]).start_timeout_s == 9.0
    assert settings(["--min-np", "1", "-np", "1", KV]).tunables.elastic_timeout_s == 77.0
    assert (
        settings(
            ["--min-np", "1", "--elastic-timeout", "5", "-np", "1", KV]
        ).tunables.elastic_timeout_s
        == 5.0
    )
    monkeypatch.setenv(cfg.START_TIMEOUT, "50")  # ours wins over Horovod's
    assert settings(["-np", "1", KV]).start_timeout_s == 50.0
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "soon")
    monkeypatch.delenv(cfg.START_TIMEOUT)
    with pytest.raises(
        HvdliteConfigError, match="HOROVOD_START_TIMEOUT='soon' is not a valid float"
    ):
        settings(["-np", "1", KV])


def test_horovod_variables_are_forwarded_like_ours(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1048576")
    monkeypatch.setenv("HOROVOD_RANK", "3")  # an identity alias: set per rank
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    fwd = rank_env.forward_env(settings(["-np", "1", KV]))
    assert fwd["HOROVOD_FUSION_THRESHOLD"] == "1048576"
    assert "HOROVOD_RANK" not in fwd and "UNRELATED_SECRET" not in fwd


@pytest.mark.timeout(90)
def test_horovod_variables_reach_ssh_hosts(sshd):
    r = run_launcher(
        [
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            *sshd.ssh_args(),
            KV,
            "--print-env",
            "HOROVOD_CYCLE_TIME,HOROVOD_RANK",
        ],
        env={"HOROVOD_CYCLE_TIME": "7", "HOROVOD_RANK": "9"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    remote = re.findall(r"^\[1\]<stdout>:ENV (.*)$", r.stdout, re.M)
    assert "HOROVOD_CYCLE_TIME=7" in remote and "HOROVOD_RANK=1" in remote


@pytest.mark.timeout(120)
def test_workers_use_horovod_variables_and_warn_once_each():
    """Across processes: HOROVOD_* fill in, a flag (HVDLITE_*) wins, one warning per rank."""
    r = run_launcher(
        ["-np", "2", "--cycle-time-ms", "3", worker("config_worker.py")],
        timeout=100,
        env={
            "HOROVOD_FUSION_THRESHOLD": "1048576",
            "HOROVOD_CYCLE_TIME": "9",
            "HOROVOD_CACHE_CAPACITY": "7",
            "HOROVOD_TORUS_ALLREDUCE": "1",
        },
    )
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert (
            f"[{rank}]<stdout>:CONFIG rank={rank} size=2 fusion=1048576 cycle=3.0 cache=7"
            in r.stdout
        ), r.stdout
    # one per rank: printed once for both ([0-1]) when they come together, else one each
    warnings = re.findall(
        r"^\[([\d-]+)\]<stderr>:.*Horovod variables have no effect.*$", r.stderr, re.M
    )
    assert sorted(warnings) in (["0", "1"], ["0-1"]), r.stderr
    line = [x for x in r.stderr.splitlines() if "no effect" in x][0]
    assert "HOROVOD_TORUS_ALLREDUCE=1 (hvdlite has no torus allreduce" in line
    assert f"HOROVOD_CYCLE_TIME=9 ({cfg.CYCLE_TIME}=3.0 is set and wins)" in line


@pytest.mark.timeout(120)
def test_the_fusion_threshold_flag_reaches_the_runtime_through_one_config():
    """--fusion-threshold-mb is validated once into the job's Config (what the launcher
    reads), reaches every rank's Config and the runtime's live parameters, which is what
    its fusion planning uses."""
    argv = ["-np", "2", "--fusion-threshold-mb", "3", worker("config_worker.py")]
    assert settings(argv).tunables.fusion_threshold_bytes == 3 * 1024 * 1024
    r = run_launcher(argv, timeout=100)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        line = re.search(rf"^\[{rank}\]<stdout>:CONFIG (.*)$", r.stdout, re.M).group(1)
        assert f"fusion={3 * 1024 * 1024} " in line and line.endswith(
            f"live_fusion={3 * 1024 * 1024}"
        ), line


# ---------------------------------------------------------------- Horovod's YAML config file

#: horovodrun's own test file format (test/single/data/config.test.yaml), features hvdlite
#: lacks turned off
HOROVOD_YAML = """\
controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: false
  hierarchical_allgather: false

autotune:
  enabled: false
  log_file: 'horovod_autotune_log.txt'
  warmup_samples: 5
  steps_per_sample: 20
  cycles_per_sample: 10

timeline:
  enabled: false
  filename: 'horovod_timeline.json'
  mark_cycles: true

stall_check:
  enabled: false
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: false
  gloo_timeout_seconds: 60
  mlsl_bgt_affinity: 0

logging:
  level: INFO
  hide_timestamp: true

elastic:
  min_np: 1
  max_np: 2
  cooldown_range: [1, 5]
"""


def test_horovod_yaml_is_read_as_is(tmp_path):
    f = tmp_path / "horovod.yaml"
    f.write_text(HOROVOD_YAML)
    s = settings(["--config-file", str(f), "-np", "1", KV])
    e = s.tunable_env()
    # what a rank reads from the launcher's variables for it
    c = cfg.Config.from_env(e)
    assert (c.fusion_threshold_bytes, c.cycle_time_ms, c.cache_capacity) == (32 << 20, 10.0, 2048)
    assert not c.stall_check and e[cfg.STALL_CHECK_DISABLE] == "1"
    assert (c.stall_check_warning_time_s, c.stall_check_shutdown_time_s) == (120.0, 240.0)
    assert (c.op_timeout_s, c.log_level, c.cpu_operations) == (60.0, "INFO", "gloo")
    assert (s.elastic.min_np, s.elastic.max_np, s.elastic.cooldown_range) == (1, 2, (1.0, 5.0))
    # command-line flags win over the file, the controller included
    f.write_text("controller: mpi\nparams:\n  cycle_time_ms: 10\n")
    s = settings(["--config-file", str(f), "-np", "1", KV])
    assert s.tunable_env()[cfg.CYCLE_TIME] == "10.0" and s.controller == "mpi"
    s = settings(["--config-file", str(f), "--cycle-time-ms", "4", "--gloo", "-np", "1", KV])
    assert s.tunable_env()[cfg.CYCLE_TIME] == "4.0" and s.controller == "gloo"


@pytest.mark.parametrize(
    "yaml_text, flag",
    [
        ("library_options:\n  num_nccl_streams: 2\n", "--num-nccl-streams"),
        ("params:\n  torus_allreduce: true\n", "--torus-allreduce"),
        ("library_options:\n  thread_affinity: 1\n", "--thread-affinity"),
        ("library_options:\n  mpi_threads_disable: true\n", "--mpi-threads-disable"),
        ("logging:\n  with_timestamp: true\n", "--log-with-timestamp"),
    ],
)
def test_horovod_yaml_asking_for_a_missing_feature_is_refused_like_its_flag(
    tmp_path, yaml_text, flag
):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(HvdliteConfigError) as info:
        settings(["--config-file", str(f), "-np", "1", KV])
    assert str(info.value).startswith(flag)


@pytest.mark.parametrize(
    "yaml_text, fragment",
    [
        ("params:\n  fusion_treshold_mb: 3\n", "unknown key 'params.fusion_treshold_mb'"),
        ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms: 'fast' is not a valid value"),
        ("params:\n  cache_capacity: true\n", "params.cache_capacity: True is not a valid int"),
        ("controller: nccl\n", "controller: 'nccl' is not 'gloo' or 'mpi'"),
        ("logging:\n  level: LOUD\n", "logging.level: 'LOUD' is not one of"),
        ("stall_check:\n  no-stall-check: maybe\n", "expected true or false"),
    ],
)
def test_horovod_yaml_errors_name_the_key(tmp_path, yaml_text, fragment):
    f = tmp_path / "c.yaml"
    f.write_text(yaml_text)
    with pytest.raises(HvdliteConfigError) as info:
        settings(["--config-file", str(f), "-np", "1", KV])
    assert fragment in str(info.value) and str(f) in str(info.value)


# ---------------------------------------------------------------- python -m hvdlite.runner


def test_python_m_hvdlite_runner():
    r = subprocess.run(
        [sys.executable, "-m", "hvdlite.runner", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert r.returncode == 0 and r.stdout.startswith("hvdlite-run 0."), r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "hvdlite.runner", "-cb"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
    )
    assert r.returncode == 0 and "Available Controllers:" in r.stdout, r.stderr
