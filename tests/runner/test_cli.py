"""The command line: flags, --config-file, -x, --check-build, and quick clear errors."""

import importlib.util
import subprocess
import sys
import time

import pytest

from hvdlite.common import config as cfg
from hvdlite.common.exceptions import HvdliteConfigError, HvdliteLaunchError
from hvdlite.runner.agent import rank_env
from hvdlite.runner.agent.job import run_job
from hvdlite.runner.cli import launch

from conftest import free_port, run_launcher, worker

pytestmark = pytest.mark.timeout(60)
KV = worker("kv_worker.py")
#: modules imported before these tests ran (--check-build must not import TensorFlow)


def settings(argv):
    return launch.spec_from_args(launch.parse_args(argv))


def test_tunable_flags_map_to_env():
    s = settings(
        [
            "-np",
            "2",
            "--fusion-threshold-mb",
            "32",
            "--cycle-time-ms",
            "2.5",
            "--cache-capacity",
            "0",
            "--no-stall-check",
            "--stall-check-warning-time-seconds",
            "7",
            "--stall-check-shutdown-time-seconds",
            "9",
            "--log-level",
            "DEBUG",
            "--start-timeout",
            "12",
            "--gloo",
            KV,
        ]
    )
    e = s.tunable_env()
    assert e[cfg.FUSION_THRESHOLD] == str(32 * 1024 * 1024)
    assert e[cfg.CYCLE_TIME] == "2.5" and e[cfg.CACHE_CAPACITY] == "0"
    assert e[cfg.STALL_CHECK_DISABLE] == "1" and e[cfg.STALL_CHECK_WARNING_TIME] == "7.0"
    assert e[cfg.STALL_CHECK_SHUTDOWN_TIME] == "9.0" and e[cfg.LOG_LEVEL] == "DEBUG"
    assert e[cfg.START_TIMEOUT] == "12.0" and e[cfg.CPU_OPERATIONS] == "gloo"
    assert s.start_timeout_s == 12.0
    # every produced value is understood by the runtime's config reader
    cfg.Config.from_env(e)
    assert s.command == [sys.executable, KV]


def test_config_file_and_flags_win(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "fusion-threshold-mb: 16\ncycle_time_ms: 3\nverbose: true\n"
        "stall:\n  stall-check-warning-time-seconds: 7\n"
        "hosts: localhost:2,127.0.0.1:2\nx: [A_VAR=1]\n"
    )
    s = settings(["--config-file", str(f), "-np", "3", "--cycle-time-ms", "5", KV])
    assert s.tunable_env()[cfg.FUSION_THRESHOLD] == str(16 * 1024 * 1024)
    assert s.tunable_env()[cfg.CYCLE_TIME] == "5.0"  # the flag wins
    assert s.tunable_env()[cfg.STALL_CHECK_WARNING_TIME] == "7.0"
    # the file's hosts, holding the -np 3 ranks host by host (placed once, in the spec)
    assert s.verbose and [(h.hostname, h.slots) for h in s.hosts] == [
        ("localhost", 2),
        ("127.0.0.1", 1),
    ]
    assert s.user_env == {"A_VAR": "1"}


def test_default_start_timeout_is_the_workers_default():
    assert settings(["-np", "1", KV]).start_timeout_s == cfg.Config.start_timeout_s


@pytest.mark.parametrize(
    "args, var, value",
    [
        (["--timeline-filename", "/tmp/t.json"], cfg.TIMELINE, "/tmp/t.json"),
        (["--timeline-mark-cycles"], cfg.TIMELINE_MARK_CYCLES, "1"),
        (["--autotune"], cfg.AUTOTUNE, "1"),
        (["--no-autotune"], cfg.AUTOTUNE, None),  # the default: nothing to hand over
        (["--autotune-log-file", "/tmp/a.csv"], cfg.AUTOTUNE_LOG, "/tmp/a.csv"),
        (["--autotune-warmup-samples", "2"], cfg.AUTOTUNE_WARMUP_SAMPLES, "2"),
        (["--autotune-steps-per-sample", "4"], cfg.AUTOTUNE_STEPS_PER_SAMPLE, "4"),
        (["--autotune-bayes-opt-max-samples", "9"], cfg.AUTOTUNE_BAYES_OPT_MAX_SAMPLES, "9"),
        (["--autotune-gaussian-process-noise", "0.5"], cfg.AUTOTUNE_GAUSSIAN_PROCESS_NOISE, "0.5"),
    ],
)
def test_timeline_and_autotune_flags_set_their_variables(args, var, value):
    env = settings(["-np", "1", *args, KV]).tunable_env()
    assert env.get(var) == value
    cfg.Config.from_env(env)  # the runtime understands every value


def test_timeline_in_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("timeline:\n  timeline-filename: /tmp/tl.json\n")
    env = settings(["--config-file", str(f), "-np", "1", KV]).tunable_env()
    assert env[cfg.TIMELINE] == "/tmp/tl.json"


def test_command_that_cannot_start_is_a_launch_error(tmp_path, capsys):
    script = tmp_path / "not_executable"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(HvdliteLaunchError, match="rank 0 on host .*cannot start"):
        run_job(settings(["-np", "1", str(script)]))
    assert launch.main(["-np", "1", str(script)]) == 2
    assert "hvdlite-run: error: rank 0 on host" in capsys.readouterr().err


def test_config_file_unknown_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("fusion-treshold-mb: 16\n")
    with pytest.raises(HvdliteConfigError, match="unknown key 'fusion-treshold-mb'"):
        settings(["--config-file", str(f), "-np", "1", KV])


def test_env_forwarding_allow_list(monkeypatch):
    monkeypatch.setenv("MY_SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("FROM_ENV", "yes")
    monkeypatch.setenv(cfg.CYCLE_TIME, "4")
    monkeypatch.setenv(cfg.SECRET_KEY, "abcd")  # a stale job var must not travel
    s = settings(["-np", "1", "-x", "FROM_ENV", "-x", "SET_HERE=1", KV])
    fwd = rank_env.forward_env(s)
    assert fwd["FROM_ENV"] == "yes" and fwd["SET_HERE"] == "1"
    assert fwd[cfg.CYCLE_TIME] == "4" and "PATH" in fwd
    assert "MY_SECRET_TOKEN" not in fwd and cfg.SECRET_KEY not in fwd
    assert set(fwd) <= {"FROM_ENV", "SET_HERE", "PATH", "PYTHONPATH", "LD_LIBRARY_PATH"} | {
        k for k in fwd if k.startswith("HVDLITE_")
    }


def test_version_check_build_and_help():
    r = run_launcher(["-v"])
    assert r.returncode == 0 and r.stdout.startswith("hvdlite-run 0.")
    r = run_launcher(["--check-build"])
    assert r.returncode == 0
    assert "[X] PyTorch" in r.stdout and "Gloo" in r.stdout and "MPI" in r.stdout
    has_tf = importlib.util.find_spec("tensorflow") is not None
    assert f"{'[X]' if has_tf else '[ ]'} TensorFlow" in r.stdout
    ops = r.stdout.split("Available Tensor Operations:")[1].split()
    assert ops[:10] == ["[", "]", "NCCL", "[", "]", "DDL", "[", "]", "CCL", "[X]"], r.stdout
    assert "CPU tensors only" in r.stdout
    r = run_launcher(["--help"])
    assert r.returncode == 0
    assert "--timeline-filename" in r.stdout and "--autotune-log-file" in r.stdout
    for group in (
        "host arguments",
        "SSH",
        "controller parameters",
        "tunable parameters",
        "timeline parameters",
        "stall check parameters",
        "autotune parameters",
    ):
        assert group in r.stdout


def _frameworks_shown(capsys):
    assert launch.main(["--check-build"]) == 0
    out = capsys.readouterr().out
    frameworks = out.split("Available Frameworks:")[1].split("Available Controllers:")[0]
    return [line.strip() for line in frameworks.strip().splitlines()]


@pytest.mark.parametrize("missing", [(), ("tensorflow",), ("torch",), ("tensorflow", "torch")])
def test_check_build_marks_each_framework_that_is_installed(missing, capsys, monkeypatch):
    """TensorFlow and PyTorch are both listed, [X] exactly where they are found; found,
    not imported (TensorFlow's import takes seconds)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    shown = _frameworks_shown(capsys)
    expected = [
        f"{'[ ]' if m in missing or real(m) is None else '[X]'} {name}"
        for name, m in (("TensorFlow", "tensorflow"), ("PyTorch", "torch"))
    ]
    assert shown == expected


def test_check_build_finds_tensorflow_without_importing_it():
    """A fresh process: other tests of this one may have imported TensorFlow already."""
    code = (
        "import sys; from hvdlite.runner.cli import launch; out = launch.check_build(); "
        "assert 'tensorflow' not in sys.modules, 'check_build imported tensorflow'; "
        "print(out)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "TensorFlow" in r.stdout and "PyTorch" in r.stdout


def _bad(args, fragment, tmp_path=None):
    t = time.monotonic()
    r = run_launcher(args, timeout=30)
    took = time.monotonic() - t
    assert r.returncode != 0, r.stdout + r.stderr
    assert fragment in r.stderr, r.stderr
    assert took < 15, f"took {took:.1f}s"
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_bad_inputs_quick_clear_errors(tmp_path):
    _bad(["-np", "0", KV], "-np 0")
    _bad(["-np", "3", "-H", "localhost:2", KV], "more processes than the 2 slots")
    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=2\nnode2 slots=two\n")
    _bad(["-np", "2", "--hostfile", str(hf), KV], "line 2")
    _bad(
        ["-np", "2", "-H", "localhost:1,no-such-host.invalid:1", KV],
        "unknown host 'no-such-host.invalid'",
    )
    _bad(["-np", "2", "--no-such-flag", KV], "unrecognized arguments: --no-such-flag")
    _bad(["-np", "2", str(tmp_path / "missing.py")], "missing.py' not found")
    _bad(["-np", "2", "no-such-command-xyz"], "'no-such-command-xyz' not found")
    _bad(["-np", "2"], "no training command")
    _bad([KV], "-np is required")
    _bad(["-np", "1", "-i", str(tmp_path / "nokey"), KV], "-i/--ssh-identity-file")


def test_closed_ssh_port_names_host():
    port = free_port()
    r = _bad(
        ["-np", "2", "-H", "127.0.0.1:1,127.0.0.2:1", "-p", str(port), KV], f"127.0.0.2:{port}"
    )
    assert "cannot connect" in r.stderr and "-p/--ssh-port" in r.stderr


def test_launcher_imports_no_framework():
    import subprocess

    code = (
        "import sys, hvdlite.runner.cli.launch, hvdlite.runner.agent.job, hvdlite.runner.tasks.task_service, "
        "hvdlite.runner.tasks.driver_service, hvdlite.runner.tasks.ssh, hvdlite.runner.starters.mpiexec, "
        "hvdlite.runner.processes.rank_output, hvdlite.common.net.kv; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow') "
        "or m.startswith('hvdlite.torch')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_launcher_imports_paramiko_only_for_a_remote_host():
    """paramiko costs ~0.1 s of CPU a launch; a job on this host alone never needs it."""
    import subprocess

    code = (
        "import sys, hvdlite.runner.cli.launch, hvdlite.runner.tasks.ssh as ssh; "
        "assert 'paramiko' not in sys.modules; p = ssh._paramiko(); "
        "assert p.SSHClient and 'paramiko' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# ---------------------------------------------------------------- elastic flags


def _discovery_script(tmp_path, mode=0o755):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(mode)
    return str(script)


def test_elastic_flags_to_settings(tmp_path, monkeypatch):
    script = _discovery_script(tmp_path)
    s = settings(
        [
            "-np",
            "3",
            "--min-np",
            "2",
            "--max-np",
            "4",
            "--host-discovery-script",
            script,
            "--slots-per-host",
            "2",
            "--elastic-timeout",
            "30",
            "--reset-limit",
            "5",
            "--blacklist-cooldown-range",
            "10",
            "20",
            KV,
        ]
    )
    e = s.elastic
    assert (
        e.np,
        e.min_np,
        e.max_np,
        s.tunables.elastic_timeout_s,
        e.reset_limit,
        e.cooldown_range,
    ) == (3, 2, 4, 30.0, 5, (10.0, 20.0))
    assert s.discovery_script == script and s.slots_per_host == 2 and s.hosts == []
    assert s.tunable_env()[cfg.CPU_OPERATIONS] == "gloo"
    # Horovod's defaults: 600 s, no reset limit, no cooldown; -np from --min-np
    s = settings(["--min-num-proc", "2", "--max-num-proc", "3", "-H", "localhost:3", KV])
    e = s.elastic
    assert (
        e.np,
        e.min_np,
        e.max_np,
        s.tunables.elastic_timeout_s,
        e.reset_limit,
        e.cooldown_range,
    ) == (2, 2, 3, 600.0, None, None)
    assert s.discovery_script is None and s.hosts[0].slots == 3
    # static jobs stay static; the job's own HVDLITE_ELASTIC never travels
    assert settings(["-np", "2", KV]).elastic is None
    monkeypatch.setenv(cfg.ELASTIC, "1")
    assert cfg.ELASTIC not in rank_env.forward_env(settings(["-np", "1", KV]))


def test_elastic_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        f"min-np: 1\nmax-np: 2\nhost-discovery-script: {_discovery_script(tmp_path)}\n"
        "blacklist-cooldown-range: [1, 5]\n"
    )
    e = settings(["--config-file", str(f), "-np", "2", KV]).elastic
    assert (e.min_np, e.max_np, e.cooldown_range) == (1, 2, (1.0, 5.0))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["-np", "2", "--min-np", "3", "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
        (
            ["-np", "5", "--min-np", "2", "--max-np", "4"],
            "-np 5 must be between --min-np 2 and --max-np 4",
        ),
        (["-np", "1", "--min-np", "2"], "-np 1 must be between --min-np 2"),
        (["-np", "2", "--min-np", "0"], "--min-np 0: must be at least 1"),
        (["-np", "2", "--max-np", "4", "--mpi"], "cannot be used with --mpi"),
        (["--max-np", "4"], "-np is required (the number of processes) or --min-np"),
        (["-np", "2", "--min-np", "1", "--elastic-timeout", "-1"], "--elastic-timeout -1"),
        (["-np", "2", "--min-np", "1", "--reset-limit", "-1"], "--reset-limit -1"),
        (["-np", "2", "--min-np", "1", "--slots-per-host", "0"], "--slots-per-host 0"),
        (
            ["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "5", "1"],
            "--blacklist-cooldown-range 5 1: expected 0 <= MIN <= MAX",
        ),
        (["-np", "2", "--reset-limit", "3"], "--reset-limit applies to elastic jobs only"),
        (["-np", "2", "--elastic-timeout", "3"], "--elastic-timeout applies to elastic jobs only"),
        (["-np", "3", "--min-np", "1", "-H", "localhost:2"], "more processes than the 2 slots"),
    ],
)
def test_elastic_flag_errors(args, fragment):
    with pytest.raises(HvdliteConfigError) as info:
        settings(args + [KV])
    assert fragment in str(info.value)


def test_discovery_script_errors(tmp_path):
    with pytest.raises(HvdliteConfigError, match="--host-discovery-script .*missing.sh: no such"):
        settings(["-np", "2", "--host-discovery-script", str(tmp_path / "missing.sh"), KV])
    script = _discovery_script(tmp_path, mode=0o644)
    with pytest.raises(HvdliteConfigError, match="not executable"):
        settings(["-np", "2", "--host-discovery-script", script, KV])
    script = _discovery_script(tmp_path)
    with pytest.raises(HvdliteConfigError, match="replaces -H/--hostfile"):
        settings(["-np", "2", "--host-discovery-script", script, "-H", "localhost:2", KV])


def test_elastic_errors_through_main(tmp_path, capsys):
    assert launch.main(["-np", "2", "--min-np", "3", KV]) == 2
    assert capsys.readouterr().err.startswith(
        "hvdlite-run: error: -np 2 must be between --min-np 3"
    )
    r = _bad(["-np", "2", "--max-np", "3", "--mpi", KV], "an MPI job cannot change its world")
    assert "--mpi" in r.stderr
