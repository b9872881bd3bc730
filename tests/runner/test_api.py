"""hvdlite.run (horovod.run): a Python function on every rank, results back in rank order,
through the real launcher (local Gloo, mpiexec, SSH hosts) and an authenticated service."""

import subprocess
import sys
import threading
import time

import pytest

import hvdlite
from hvdlite.common.exceptions import HvdliteAuthError, HvdliteConfigError
from hvdlite.common.net.framing import new_key
from hvdlite.common.net.service import Client
from hvdlite.runner import api

from conftest import REPO, WORKERS

sys.path.insert(0, WORKERS)
import run_funcs  # noqa: E402  (the ranks import it too, through PYTHONPATH)

pytestmark = pytest.mark.timeout(60)
#: the ranks import run_funcs (by reference) from the workers folder
RANK_ENV = {"PYTHONPATH": WORKERS}


def test_results_come_back_in_rank_order():
    got = hvdlite.run(run_funcs.whoami, np=2, env=RANK_ENV)
    assert [g["rank"] for g in got] == [0, 1] and {g["size"] for g in got} == {"2"}


def test_no_command_line_is_made_or_parsed(monkeypatch):
    """hvdlite.run sets hvdlite-run's options from its arguments: neither argparse nor the
    launcher's parser runs, and the job goes through run_job like the command line's."""
    import argparse

    from hvdlite.runner.agent import job as agent_job

    def refuse(*args, **kwargs):
        raise AssertionError("hvdlite.run parsed a command line")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", refuse)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", refuse)
    specs = []
    real = agent_job.run_job
    monkeypatch.setattr(api, "run_job", lambda spec: specs.append(spec) or real(spec))
    assert hvdlite.run(lambda: 7, np=2, start_timeout=30, env={"HVDLITE_CYCLE_TIME": "2"}) == [7, 7]
    assert [(s.name, s.np, s.start_timeout_s) for s in specs] == [("hvdlite.run", 2, 30.0)]
    assert specs[0].tunables.cycle_time_ms == 2.0  # env= counts in the one Config


def test_lambdas_args_and_kwargs_travel_by_value():
    assert hvdlite.run(lambda x, y=1: x + y, args=(40,), kwargs={"y": 2}, np=2) == [42, 42]


def test_a_failing_rank_is_named_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(api.RunFunctionError) as info:
        hvdlite.run(run_funcs.fail_on, args=(1,), np=2, env=RANK_ENV)
    assert info.value.rank == 1
    assert "rank 1" in str(info.value) and "Traceback (most recent call last)" in str(info.value)
    assert "ValueError: rank 1 fails on purpose" in info.value.remote_traceback
    assert time.monotonic() - start < 30  # rank 0 (sleeping 60 s) was ended


def test_a_result_that_cannot_be_pickled_is_a_rank_failure():
    with pytest.raises(api.RunFunctionError, match="result cannot be pickled"):
        hvdlite.run(run_funcs.unpicklable_result, np=1, env=RANK_ENV)


@pytest.mark.timeout(120)
def test_the_function_can_train_with_hvdlite_torch():
    got = hvdlite.run(run_funcs.allreduce_rank, np=2, env=RANK_ENV)
    assert got == [(0, 2, 1.0), (1, 2, 1.0)]


@pytest.mark.timeout(90)
def test_under_mpi_and_the_key_stays_off_command_lines(monkeypatch, capfd):
    key = bytes(range(32))
    monkeypatch.setattr(api, "new_key", lambda: key)
    got = hvdlite.run(run_funcs.whoami, np=2, use_mpi=True, verbose=True, env=RANK_ENV)
    assert [g["rank"] for g in got] == [0, 1]
    out = capfd.readouterr()
    assert "mpiexec" in out.err or "mpirun" in out.err  # --verbose printed the command
    assert key.hex() not in out.out + out.err


@pytest.mark.timeout(90)
def test_on_ssh_hosts(sshd):
    got = hvdlite.run(
        run_funcs.whoami,
        np=2,
        hosts="127.0.0.1:1,127.0.0.2:1",
        ssh_port=sshd.port,
        ssh_identity_file=sshd.identity,
        env=RANK_ENV,
    )
    assert [(g["rank"], g["host"]) for g in got] == [(0, "127.0.0.1"), (1, "127.0.0.2")]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"min_np": 1}, "static jobs only (min_np given)"),
        ({"hosts": "localhost:1", "hostfile": "h"}, "hosts or hostfile, not both"),
        ({"use_gloo": True, "use_mpi": True}, "exclude each other"),
        ({"args": (threading.Lock(),)}, "cannot be pickled"),
        ({"use_jsrun": True}, "--jsrun: jsrun (IBM LSF) is not supported"),
        ({"np": 0}, "-np 0"),
        ({"np": "2"}, "np='2' is not a number"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs, fragment):
    with pytest.raises(HvdliteConfigError) as info:
        hvdlite.run(run_funcs.whoami, **kwargs)
    assert fragment in str(info.value)


def test_the_service_ignores_frames_without_its_key():
    service = api._FunctionService(new_key(), b"payload", 2, "127.0.0.1")
    try:
        forged = Client(service.address, new_key(), timeout_s=5)
        with pytest.raises((HvdliteAuthError, ConnectionError)):
            forged.request({"op": "result", "rank": 0}, b"not a pickle")
        forged.close()
        assert service.results == {} and service.rejected >= 1  # the client retries once
    finally:
        service.shutdown()


def test_import_hvdlite_stays_light():
    code = (
        "import sys, hvdlite; "
        "assert not [m for m in sys.modules if m.startswith('hvdlite.runner')]; "
        "assert callable(hvdlite.run) and 'hvdlite.runner.api' in sys.modules; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30, cwd=REPO)
