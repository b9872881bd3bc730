"""A job's spec stores each setting once: the tunables in its one Config, the ranks'
variables derived from it."""

import dataclasses
import sys

from hvdlite.common import config as cfg
from hvdlite.common.config import tunables
from hvdlite.runner.agent.settings import JobSettings, check_elastic_timeout
from hvdlite.runner.agent.spec import JobSpec
from hvdlite.runner.cli import launch

KV = "tests/runner/workers/kv_worker.py"
TUNABLE_NAMES = {n for t in tunables.TUNABLES for n in (t.env, *t.horovod)}


def _spec(*flags: str) -> JobSpec:
    return launch.spec_from_args(launch.parse_args(["-np", "1", *flags, sys.executable, KV]))


def test_the_spec_stores_no_setting_its_config_holds():
    """No field of JobSpec is also a tunable of Config (the start timeout was once stored
    three times), and no field of a launched spec holds a tunable's variable: the
    ranks' variables are derived from the Config when the job starts."""
    spec_fields = {f.name for f in dataclasses.fields(JobSpec)}
    config_fields = {f.name for f in dataclasses.fields(cfg.Config)}
    assert {t.field for t in tunables.TUNABLES} <= config_fields
    assert spec_fields & {t.field for t in tunables.TUNABLES} == set()
    # nor the elastic settings it carries (the elastic timeout was once kept in both)
    settings_fields = {f.name for f in dataclasses.fields(JobSettings)}
    assert settings_fields & {t.field for t in tunables.TUNABLES} == set()
    spec = _spec("--cycle-time-ms", "3", "--start-timeout", "12", "--mpi")
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, dict):
            assert not set(value) & TUNABLE_NAMES, (f.name, value)
    assert (spec.tunables.cycle_time_ms, spec.start_timeout_s, spec.controller) == (
        3.0,
        12.0,
        "mpi",
    )


def test_the_ranks_variables_follow_the_config():
    spec = _spec("--cycle-time-ms", "3")
    assert spec.tunable_env()[cfg.CYCLE_TIME] == "3.0"
    spec.tunables = spec.tunables.replace(cycle_time_ms=7.5)
    assert spec.tunable_env()[cfg.CYCLE_TIME] == "7.5"
    spec.with_start_timeout(5)
    assert spec.start_timeout_s == 5.0 and spec.tunable_env()[cfg.START_TIMEOUT] == "5.0"


def test_a_config_reads_back_from_its_own_variables():
    c = cfg.Config().replace(
        fusion_threshold_bytes=5 << 20,
        cycle_time_ms=2.5,
        stall_check=False,
        log_level="DEBUG",
        timeline_filename="t.json",
        autotune=True,
        cpu_operations="mpi",
        shared_memory=False,
    )
    back = cfg.Config.from_env(c.tunable_env({}))
    for t in tunables.TUNABLES:
        assert getattr(back, t.field) == getattr(c, t.field), t.field
    assert cfg.Config().tunable_env({}) == {}  # the defaults need no variables


def test_only_what_the_inherited_variables_do_not_say_is_handed_over():
    c = cfg.Config().replace(cycle_time_ms=2.5)
    # the rank inherits Horovod's twin with the same value: nothing to add
    assert c.tunable_env({"HOROVOD_CYCLE_TIME": "2.5", "PATH": "/bin"}) == {}
    # a flag at the default beats the launcher's variable: the default goes over
    assert cfg.Config().tunable_env({cfg.CYCLE_TIME: "9"}) == {cfg.CYCLE_TIME: "1.0"}
    # an inherited value the ranks could not read is mended by every variable
    env = c.tunable_env({cfg.CACHE_CAPACITY: "many"})
    assert env[cfg.CACHE_CAPACITY] == "1024" and len(env) == len(tunables.TUNABLES)


def test_the_controller_is_stored_once_and_reaches_the_ranks_from_there(monkeypatch):
    """``cpu_operations`` lives in the Config alone: the flag's (--mpi) or a platform's
    (Gloo); the ranks' HVDLITE_CPU_OPERATIONS is derived from it, for mpiexec too."""
    monkeypatch.delenv(cfg.CPU_OPERATIONS, raising=False)
    spec = _spec("--mpi")
    assert spec.controller == "mpi" and spec.tunable_env()[cfg.CPU_OPERATIONS] == "mpi"
    monkeypatch.setenv(cfg.CYCLE_TIME, "4")
    platform = JobSpec(np=1, hosts=[], command=[])  # Ray's, Spark's, a srun step's
    assert platform.controller == "gloo" and platform.tunables.cycle_time_ms == 4.0
    assert platform.tunable_env() == {cfg.CPU_OPERATIONS: "gloo"}


def test_the_launch_options_are_the_parsers_flags():
    """LaunchOptions has a field for every flag that is not a tunable, at the parser's
    default, and keeps the tunable flags by dest: a flag added to one and not the other
    fails here (and ``from_namespace`` would refuse it)."""
    from hvdlite.runner.cli import flags
    from hvdlite.runner.cli.options import LaunchOptions

    parser = flags.shared_parser()
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(LaunchOptions)}
    assert dests - set(flags.TUNABLE_FLAGS) == fields - {"tunable_values", "config_file_keys"}
    blank = LaunchOptions.from_namespace(parser.parse_args([]))
    assert blank == LaunchOptions()
    parsed = launch.parse_args(["-np", "3", "--fusion-threshold-mb", "8", "--mpi", "t.py"])
    assert (parsed.np, parsed.mpi, parsed.command) == (3, True, ["t.py"])
    assert parsed.tunable_values == {"fusion_threshold_mb": 8.0}
    assert parsed.value("fusion_threshold_mb") == 8.0 and parsed.value("cycle_time_ms") is None


def test_launch_options_built_in_code_are_checked_like_flags():
    """hvdlite.run's path: options made without a command line get the command line's
    checks and messages, and the caller's options are left as they were."""
    import pytest
    from hvdlite.common.exceptions import HvdliteConfigError
    from hvdlite.runner.cli.options import LaunchOptions

    options = LaunchOptions(
        min_np=1, command=[sys.executable, KV], tunable_values={"op_timeout_seconds": 9.0}
    )
    spec = launch.spec_from_args(options)
    assert (spec.np, spec.tunables.op_timeout_s, options.np) == (1, 9.0, None)
    with pytest.raises(HvdliteConfigError, match="--fusion-threshold-mb -1"):
        launch.spec_from_args(
            LaunchOptions(
                np=1, command=[sys.executable, KV], tunable_values={"fusion_threshold_mb": -1.0}
            )
        )


def test_an_elastic_timeout_is_kept_in_the_tunables_alone():
    """--elastic-timeout is the tunable's flag: the spec's Config holds it, the ranks'
    variable is derived from it, and a platform's argument is checked by the same rule."""
    import pytest
    from hvdlite.common.exceptions import HvdliteConfigError

    spec = _spec("--min-np", "1", "--elastic-timeout", "42")
    assert spec.tunables.elastic_timeout_s == 42.0
    assert spec.tunable_env()[cfg.ELASTIC_TIMEOUT] == "42.0"
    assert (
        JobSpec(np=1, hosts=[], command=[]).with_elastic_timeout(7).tunables.elastic_timeout_s
        == 7.0
    )
    assert check_elastic_timeout(None, "x") is None
    with pytest.raises(HvdliteConfigError, match=r"RayExecutor: elastic_timeout=-1: "):
        check_elastic_timeout(-1, "RayExecutor: elastic_timeout")
