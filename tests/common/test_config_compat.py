"""Horovod's environment carried over: HOROVOD_* fallbacks, precedence, the one warning; a
process torchrun started takes its place from torchrun's variables (or is refused when
asked), and mpiexec with Gloo but without hvdlite-run is refused."""

import logging
import re

import pytest

from hvdlite.common import config as cfg
from hvdlite.common.config import Config
from hvdlite.common.exceptions import HvdliteConfigError

pytestmark = pytest.mark.timeout(30)

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_RANK": "1",
}


@pytest.fixture
def warnings_seen(monkeypatch, caplog):
    """The config module's warnings, each note logged afresh (the module logs a note once)."""
    monkeypatch.setattr(cfg, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger="hvdlite.common.config")
    return caplog


def horovod_warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if "Horovod variables have no effect" in r.getMessage()
    ]


# ---------------------------------------------------------------- fallbacks and precedence


@pytest.mark.parametrize(
    "horovod, value, field, expected",
    [
        ("HOROVOD_FUSION_THRESHOLD", "33554432", "fusion_threshold_bytes", 32 * 1024 * 1024),
        ("HOROVOD_CYCLE_TIME", "3.5", "cycle_time_ms", 3.5),  # ms, as ours
        ("HOROVOD_CACHE_CAPACITY", "0", "cache_capacity", 0),
        ("HOROVOD_STALL_CHECK_DISABLE", "1", "stall_check", False),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "12", "stall_check_warning_time_s", 12.0),
        ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "30", "stall_check_shutdown_time_s", 30.0),
        ("HOROVOD_LOG_LEVEL", "info", "log_level", "INFO"),
        ("HOROVOD_LOG_LEVEL", "TRACE", "log_level", "DEBUG"),
        ("HOROVOD_LOG_LEVEL", "FATAL", "log_level", "CRITICAL"),
        ("HOROVOD_GLOO_TIMEOUT_SECONDS", "45", "op_timeout_s", 45.0),
        ("HOROVOD_CPU_OPERATIONS", "MPI", "cpu_operations", "mpi"),
        ("HOROVOD_CONTROLLER", "mpi", "cpu_operations", "mpi"),
        ("HOROVOD_START_TIMEOUT", "90", "start_timeout_s", 90.0),
        ("HOROVOD_ELASTIC_TIMEOUT", "120", "elastic_timeout_s", 120.0),
        ("HOROVOD_DYNAMIC_PROCESS_SETS", "1", "dynamic_process_sets", True),
        ("HOROVOD_TIMELINE", "/tmp/tl.json", "timeline_filename", "/tmp/tl.json"),
        ("HOROVOD_TIMELINE_MARK_CYCLES", "1", "timeline_mark_cycles", True),
        ("HOROVOD_AUTOTUNE", "1", "autotune", True),
        ("HOROVOD_AUTOTUNE_LOG", "/tmp/a.csv", "autotune_log_file", "/tmp/a.csv"),
        ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "5", "autotune_warmup_samples", 5),
        ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "7", "autotune_steps_per_sample", 7),
        ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "11", "autotune_bayes_opt_max_samples", 11),
        ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.3", "autotune_gaussian_process_noise", 0.3),
    ],
)
def test_horovod_variable_is_a_fallback(horovod, value, field, expected, warnings_seen):
    assert getattr(Config.from_env({horovod: value}), field) == expected
    assert horovod_warnings(warnings_seen) == []


def test_every_fallback_is_tested_and_maps_to_a_known_variable():
    tested = {
        "HOROVOD_FUSION_THRESHOLD",
        "HOROVOD_CYCLE_TIME",
        "HOROVOD_CACHE_CAPACITY",
        "HOROVOD_STALL_CHECK_DISABLE",
        "HOROVOD_STALL_CHECK_TIME_SECONDS",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        "HOROVOD_LOG_LEVEL",
        "HOROVOD_GLOO_TIMEOUT_SECONDS",
        "HOROVOD_CPU_OPERATIONS",
        "HOROVOD_CONTROLLER",
        "HOROVOD_START_TIMEOUT",
        "HOROVOD_ELASTIC_TIMEOUT",
        "HOROVOD_TIMELINE",
        "HOROVOD_TIMELINE_MARK_CYCLES",
        "HOROVOD_AUTOTUNE",
        "HOROVOD_AUTOTUNE_LOG",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
        "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        "HOROVOD_DYNAMIC_PROCESS_SETS",
    }
    assert set(cfg.HOROVOD_FALLBACKS) == tested
    assert set(cfg.HOROVOD_FALLBACKS.values()) <= cfg._KNOWN
    assert not set(cfg.HOROVOD_FALLBACKS) & set(cfg.HOROVOD_NO_EFFECT)


def test_hvdlite_value_wins_and_a_different_twin_is_named(warnings_seen):
    c = Config.from_env(
        {
            cfg.CYCLE_TIME: "2",
            "HOROVOD_CYCLE_TIME": "9",
            cfg.FUSION_THRESHOLD: "1024",
            "HOROVOD_FUSION_THRESHOLD": "1024",
        }
    )
    assert (c.cycle_time_ms, c.fusion_threshold_bytes) == (2.0, 1024)
    [message] = horovod_warnings(warnings_seen)
    assert f"HOROVOD_CYCLE_TIME=9 ({cfg.CYCLE_TIME}=2 is set and wins)" in message
    assert "FUSION" not in message  # same value: nothing to say


def test_first_controller_twin_wins(warnings_seen):
    c = Config.from_env({"HOROVOD_CPU_OPERATIONS": "mpi", "HOROVOD_CONTROLLER": "gloo"})
    assert c.cpu_operations == "mpi"
    assert (
        "HOROVOD_CONTROLLER=gloo (HOROVOD_CPU_OPERATIONS=mpi is set and wins)"
        in horovod_warnings(warnings_seen)[0]
    )


def test_bad_horovod_value_names_the_horovod_variable():
    with pytest.raises(HvdliteConfigError, match="HOROVOD_CACHE_CAPACITY='lots'"):
        Config.from_env({"HOROVOD_CACHE_CAPACITY": "lots"})
    with pytest.raises(HvdliteConfigError, match=r"read from Horovod's HOROVOD_CYCLE_TIME=-1"):
        Config.from_env({"HOROVOD_CYCLE_TIME": "-1"})
    with pytest.raises(HvdliteConfigError, match="log level 'loud' .*HOROVOD_LOG_LEVEL=loud"):
        Config.from_env({"HOROVOD_LOG_LEVEL": "loud"})


def test_env_value_for_the_launcher():
    assert cfg.env_value(cfg.START_TIMEOUT, {"HOROVOD_START_TIMEOUT": "7"}) == "7"
    assert (
        cfg.env_value(cfg.START_TIMEOUT, {"HOROVOD_START_TIMEOUT": "7", cfg.START_TIMEOUT: "8"})
        == "8"
    )
    assert cfg.env_value(cfg.START_TIMEOUT, {}) is None
    assert cfg.horovod_twins(cfg.CPU_OPERATIONS) == ("HOROVOD_CPU_OPERATIONS", "HOROVOD_CONTROLLER")


# ---------------------------------------------------------------- the one warning


def test_no_effect_variables_are_named_in_one_warning_with_reasons(warnings_seen):
    env = {
        "HOROVOD_TORUS_ALLREDUCE": "1",
        "HOROVOD_NUM_NCCL_STREAMS": "2",
        "HOROVOD_CPU_OPERATIONS": "ccl",
        "HOROVOD_THREAD_AFFINITY": "0",
        "HOROVOD_MPI_THREADS_DISABLE": "1",
        "HOROVOD_BATCH_D2D_MEMCOPIES": "0",
        "HOROVOD_DISABLE_GROUP_FUSION": "1",
    }
    c = Config.from_env(env)
    assert c.cpu_operations == ""  # ccl is not honoured: automatic choice
    [message] = horovod_warnings(warnings_seen)
    assert "HOROVOD_TORUS_ALLREDUCE=1 (hvdlite has no torus allreduce" in message
    assert "HOROVOD_NUM_NCCL_STREAMS=2 (NCCL is GPU only" in message
    assert "HOROVOD_CPU_OPERATIONS=ccl (hvdlite runs its collectives through Gloo or MPI" in message
    for name in env:
        assert name in message
    # init() after shutdown() does not repeat it
    Config.from_env(env)
    assert len(horovod_warnings(warnings_seen)) == 1


def test_dynamic_process_sets_follow_horovods_variable():
    assert not Config.from_env(
        {"HOROVOD_DYNAMIC_PROCESS_SETS": "1", cfg.DYNAMIC_PROCESS_SETS: "0"}
    ).dynamic_process_sets
    assert not Config.from_env({}).dynamic_process_sets


def test_every_no_effect_variable_has_a_reason():
    for name, (when, why) in cfg.HOROVOD_NO_EFFECT.items():
        assert name.startswith("HOROVOD_") and when in ("any", "on", "off") and len(why) > 15


@pytest.mark.parametrize(
    "env",
    [
        {
            "HOROVOD_HIERARCHICAL_ALLREDUCE": "0",
            "HOROVOD_AUTOTUNE": "0",
            "HOROVOD_TIMELINE_MARK_CYCLES": "false",
            "HOROVOD_LOG_HIDE_TIME": "1",
        },
        {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_WITH_PYTORCH": "1"},
        {},
    ],
)
def test_defaults_identity_and_build_variables_are_quiet(env, warnings_seen):
    Config.from_env(env)
    assert horovod_warnings(warnings_seen) == []


def test_timestamps_asked_for_is_named(warnings_seen):
    Config.from_env({"HOROVOD_LOG_HIDE_TIME": "0"})
    assert (
        "HOROVOD_LOG_HIDE_TIME=0 (hvdlite's log lines carry no timestamp)"
        in horovod_warnings(warnings_seen)[0]
    )


# ---------------------------------------------------------------- other launchers


def test_torchrun_environment_places_the_rank_at_torchs_store():
    config = Config.from_env(
        dict(
            TORCHRUN_ENV,
            LOCAL_WORLD_SIZE="2",
            GROUP_RANK="0",
            TORCHELASTIC_RUN_ID="abc",
            TORCHELASTIC_RESTART_COUNT="2",
        )
    )
    assert (config.rank, config.size, config.local_rank, config.local_size) == (1, 4, 1, 2)
    assert (config.cross_rank, config.cross_size) == (0, 2)
    assert config.torch_store_addr == "127.0.0.1:29500"
    assert config.job_id == "torchrun-abc-attempt2"  # a restart meets under new keys


def test_torchrun_environment_is_refused_when_asked():
    with pytest.raises(HvdliteConfigError) as info:
        Config.from_env(dict(TORCHRUN_ENV, HVDLITE_REFUSE_TORCHRUN="1"))
    msg = str(info.value)
    assert "torchrun" in msg and "WORLD_SIZE=4" in msg and "hvdlite-run -np 4" in msg


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"RANK": "4"}, "RANK=4"),
        ({"LOCAL_WORLD_SIZE": "3"}, "same number of ranks"),
        ({"WORLD_SIZE": "four"}, "WORLD_SIZE='four'"),
    ],
)
def test_torchrun_variables_that_name_no_place_are_refused(bad, named):
    with pytest.raises(HvdliteConfigError, match=re.escape(named)):
        Config.from_env(dict(TORCHRUN_ENV, **bad))


@pytest.mark.parametrize(
    "extra",
    [
        {"WORLD_SIZE": "1"},  # one process: harmless
        {cfg.RENDEZVOUS_ADDR: "127.0.0.1", cfg.SIZE: "4", cfg.RANK: "1"},  # under hvdlite-run
        {"PMI_RANK": "1", "PMI_SIZE": "4"},  # under mpiexec
        {cfg.SIZE: "1"},  # explicitly alone
        {"MASTER_PORT": ""},  # not all four set
    ],
)
def test_other_starts_are_not_taken_for_torchrun(extra):
    env = dict(TORCHRUN_ENV, **extra)
    if not env["MASTER_PORT"]:
        del env["MASTER_PORT"]
    assert Config.from_env(env).torch_store_addr is None


def test_gloo_chosen_under_mpiexec_without_rendezvous_is_refused():
    with pytest.raises(HvdliteConfigError, match="HOROVOD_CONTROLLER=gloo .* one of 2 ranks"):
        Config.from_env({"HOROVOD_CONTROLLER": "gloo", "PMI_RANK": "0", "PMI_SIZE": "2"})
    Config.from_env({"HOROVOD_CONTROLLER": "gloo", "PMI_RANK": "0", "PMI_SIZE": "1"})
